"""Packaging: kernels/ installs as treeattn_kernels, never as a top-level `kernels` (docs/architecture.md §5);
the wheel folder installs treeattn with no index (issue 34)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import Background, start_offline_install

REPO = Path(__file__).resolve().parents[1]


def test_transformers_does_not_import_our_kernels(tmp_path):
    """With the project installed, `from transformers import LlamaConfig` (which probes for a
    `kernels` package) must not find or import ours, from any working directory."""
    probe = (
        "import importlib.util, sys\n"
        "from transformers import LlamaConfig\n"
        "import transformers.integrations.hub_kernels\n"
        "bad = [m for m in sys.modules if m == 'kernels' or m.startswith(('kernels.', 'treeattn_kernels'))]\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "ours = spec is not None and spec.origin is not None and 'treeattn' in spec.origin\n"
        f"ours = ours or (spec is not None and {str(REPO)!r} in str(spec.origin))\n"
        "print(bad, ours)\n"
        "sys.exit(1 if bad or ours else 0)\n"
    )
    for cwd in (tmp_path, REPO / "tests"):
        r = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    import treeattn_kernels

    assert Path(treeattn_kernels.__file__).parent == REPO / "kernels"


def test_wheel_has_no_top_level_kernels(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("treeattn_cli", "kernels", "profiles"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("treeattn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "kernels" not in tops, sorted(tops)
    assert "treeattn_kernels/__init__.py" in names
    assert "treeattn_kernels/partial_triton.py" in names
    assert "treeattn_cli/main.py" in names
    # every module of the tree is in the wheel (a package missing from pyproject's list is not)
    tree = {
        f"treeattn_cli/{f.relative_to(REPO / 'treeattn_cli').as_posix()}"
        for f in (REPO / "treeattn_cli").rglob("*.py")
        if "__pycache__" not in f.parts
    }
    assert tree <= set(names), sorted(tree - set(names))
    assert "treeattn_cli/profiles/dgx-h100.yaml" in names and "treeattn_cli/data/demo_document.txt" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "treeattn = treeattn_cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.fixture(scope="module")
def offline_install(tmp_path_factory):
    """``wheelhouse --check-install``'s record, started at collection (``helpers.EARLY``)."""
    start_offline_install(tmp_path_factory.mktemp("install"))  # when it was not started already
    out, err = Background.result("offline-install", timeout=900)
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"the wheelhouse check printed no record; stderr:\n{err[-3000:]}"
    return json.loads(lines[-1]), out


def test_the_wheel_folder_installs_with_no_index_and_passes_preflight(offline_install):
    """From this checkout: the wheel folder, a fresh venv holding only the machine's torch and
    Triton, ``pip install --no-index --find-links wheelhouse 'treeattn[test,serve]'`` with the
    machine's pip configuration out of play, and ``gpu_report --preflight`` passing there."""
    rec, out = offline_install
    assert rec.get("install_rc") == 0, rec.get("install_error")
    assert [m.split()[0] for m in rec["machine_own"]] == ["torch", "triton"]
    assert rec["wheels"] > 40 and rec["installed"] > rec["wheels"]  # everything else came from the folder
    assert rec["preflight_rc"] == 0, rec["preflight"]
    assert "preflight: every step can run" in rec["preflight"]
    assert "transformers       ok" in rec["preflight"] and "treeattn_kernels   ok" in rec["preflight"]
    assert "wheelhouse: " in out and "left out: torch" in out  # the build said what it left to the machine
