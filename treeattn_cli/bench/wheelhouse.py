"""A folder of wheels that installs treeattn on a machine without network (``make wheelhouse``).

    python -m treeattn_cli.bench.wheelhouse [--out wheelhouse] [--python-version 3.12
        --platform manylinux_2_28_x86_64] [--skip NAMES | --gpu-image]

Run where the package index can be reached. It builds this project's own wheel (no build
isolation: nothing is fetched to build it), resolves everything ``treeattn[test,serve]`` needs
for the target's Python and platform (binary wheels only when a platform is named), and
downloads those wheels, leaving out torch, Triton and the ``nvidia-*`` libraries (the target's
own: they are large and tied to its driver). ``--gpu-image`` also leaves out what this
workplace's GPU image already holds at versions that satisfy treeattn (``GPU_IMAGE``; carrying
them would only replace working copies), so the folder stays small enough to carry (under
60 MiB). On the target::

    pip install --no-index --find-links wheelhouse 'treeattn[test,serve]'      # a venv with torch
    pip install --no-index --no-deps --target /tmp/site wheelhouse/*.whl       # or beside the
    export PYTHONPATH=/tmp/site                                                # image's python

Prints what it kept and left out, with sizes; the folder is emptied first.

``--check-install`` (after a build, or alone on a folder built before) proves the folder is
enough: a fresh venv that holds only this machine's torch and Triton (linked, not copied)
installs ``treeattn[test,serve]`` from it with ``--no-index``, then runs ``gpu_report
--preflight`` there; prints one JSON line (seconds, what was installed, the preflight's exit
status) and exits non-zero when either step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "test,serve"
TARGET_OWN = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")  # the machine's own
# What this workplace's GPU image holds (the device tool's KINDS.md, 2026-11-17) at versions that
# satisfy treeattn's requirements; transformers (5.17 there, treeattn needs >= 5.23) is carried.
GPU_IMAGE = frozenset(
    """
accelerate annotated-doc anyio attrs certifi charset-normalizer click filelock fsspec h11 hf-xet
httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe matplotlib
contourpy cycler fonttools kiwisolver mdurl mpmath networkx numpy packaging pillow pluggy psutil
pygments pyparsing pytest python-dateutil pyyaml regex requests rich safetensors setuptools
shellingham six sortedcontainers sympy tokenizers tqdm typer typing-extensions urllib3 uvloop
""".split()
)
# The image's versions a carried package must agree with (as KINDS.md read them): the resolution
# is held to them, so e.g. the transformers carried works with the image's tokenizers.
GPU_IMAGE_PINS = {
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _platform_args(python_version: str | None, platforms: list[str]) -> list[str]:
    if not platforms and not python_version:
        return []
    args = ["--only-binary=:all:", "--implementation", "cp"]
    if python_version:
        args += ["--python-version", python_version]
    for p in platforms:
        args += ["--platform", p]
    return args


def build_own(out: Path) -> Path:
    """This project's wheel into ``out`` (no build isolation: no network needed to build it)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
    )
    return next(out.glob("treeattn-*.whl"))


def resolve(own: Path, plat: list[str], pins: dict | None = None) -> list[tuple[str, str]]:
    """``(name, version)`` of every distribution ``treeattn[test,serve]`` installs for the target
    (``pins``: versions the target holds that the resolution must keep)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--find-links",
            str(own.parent),
            *plat,
        ]
        if pins:
            (Path(tmp) / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
            cmd += ["-c", str(Path(tmp) / "pins.txt")]
        if plat:
            cmd += ["--target", str(Path(tmp) / "t")]  # pip accepts --platform only with --target
        subprocess.run(cmd + [f"{own}[{EXTRAS}]"], check=True)
        got = json.loads(report.read_text())["install"]
    return [(m["metadata"]["name"], m["metadata"]["version"]) for m in got]


def download(pins: list[tuple[str, str]], out: Path, plat: list[str]) -> None:
    if pins:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                str(out),
                *plat,
                *[f"{n}=={v}" for n, v in pins],
            ],
            check=True,
        )


def choose(resolved: list[tuple[str, str]], skip: frozenset) -> tuple[list, list]:
    """What to carry, and what is left out (and why)."""
    keep, left = [], []
    for name, ver in resolved:
        n = _norm(name)
        if n == "treeattn":
            continue
        if TARGET_OWN.match(n):
            left.append((name, ver, "the target's own"))
        elif n in skip:
            left.append((name, ver, "the target holds it"))
        else:
            keep.append((name, ver))
    return keep, left


def link_own(names: tuple[str, ...], into: Path) -> list[str]:
    """Link the installed distributions ``names`` (their top-level files, as their RECORD lists
    them) into ``into``: a venv that puts ``into`` on its path has exactly these, this machine's
    own, and nothing else of this interpreter's site-packages."""
    from importlib import metadata

    into.mkdir(parents=True, exist_ok=True)
    linked = []
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src = Path(dist.locate_file(top))
            if src.exists() and not (into / top).exists() and not top.endswith(".pth"):
                (into / top).symlink_to(src, target_is_directory=src.is_dir())
        linked.append(f"{name} {dist.version}")
    return linked


def check_install(wheels: Path, work: Path, own=("torch", "triton")) -> dict:
    """A fresh venv holding only ``own`` (this machine's, linked) installs ``treeattn[test,serve]``
    from ``wheels`` with no index, then passes ``gpu_report --preflight``: the record of it."""
    rec = {"wheels": len(list(wheels.glob("*.whl")))}
    venv = work / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    rec["machine_own"] = link_own(own, work / "machine-own")
    (site / "machine-own.pth").write_text(f"{work / 'machine-own'}\n")
    rec["venv_s"] = round(time.perf_counter() - t0, 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env["PIP_CONFIG_FILE"] = "/dev/null"  # the machine's pip configuration (indexes, find-links) plays no part
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            "--disable-pip-version-check",
            f"treeattn[{EXTRAS}]",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(work),
    )
    rec["install_s"], rec["install_rc"] = round(time.perf_counter() - t0, 1), r.returncode
    if r.returncode:
        rec["install_error"] = (r.stderr or r.stdout).strip()[-1500:]
        return rec
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, env=env)
    rec["installed"] = len(json.loads(listed.stdout or "[]"))
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(py), "-m", "treeattn_cli.bench.gpu_report", "--preflight"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(work),
    )  # from outside the checkout: the installed copy
    rec["preflight_s"], rec["preflight_rc"] = round(time.perf_counter() - t0, 1), r.returncode
    rec["preflight"] = r.stdout.strip()[-3000:] + (("\n" + r.stderr.strip()[-1500:]) if r.returncode else "")
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "wheelhouse"))
    ap.add_argument("--python-version", default=None, help="the target's Python, e.g. 3.12 (default: this one)")
    ap.add_argument(
        "--platform",
        action="append",
        default=[],
        help="the target's platform tag(s), e.g. manylinux_2_28_x86_64 (repeatable; default: this one)",
    )
    ap.add_argument("--skip", default="", help="comma-separated distributions the target already holds")
    ap.add_argument("--gpu-image", action="store_true", help="leave out what the GPU image holds (GPU_IMAGE)")
    ap.add_argument(
        "--check-install",
        action="store_true",
        help="then install from the folder into a fresh venv with only torch and Triton, no index, "
        "and run gpu_report --preflight there",
    )
    ap.add_argument("--no-build", action="store_true", help="use the folder as it is (with --check-install)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if not a.no_build:
        build(a, out)
    if not a.check_install:
        return 0
    with tempfile.TemporaryDirectory(prefix="treeattn-wheelhouse-check-") as tmp:
        rec = check_install(out, Path(tmp))
    print(json.dumps(rec))
    return 0 if rec.get("install_rc") == 0 and rec.get("preflight_rc") == 0 else 1


def build(a, out: Path) -> None:
    """The folder, as ``a`` (the parsed arguments) asks."""
    platforms = [p for item in a.platform for p in item.split(",") if p]
    if platforms and not any(p.startswith("manylinux_2_17") or p.startswith("manylinux2014") for p in platforms):
        platforms += ["manylinux_2_17_x86_64", "manylinux2014_x86_64"] if "x86_64" in platforms[0] else []
    plat = _platform_args(a.python_version, platforms)
    skip = frozenset(_norm(s) for s in a.skip.split(",") if s.strip()) | (GPU_IMAGE if a.gpu_image else frozenset())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    own = build_own(out)
    keep, left = choose(resolve(own, plat, GPU_IMAGE_PINS if a.gpu_image else None), skip)
    download(keep, out, plat)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(
        f"wheelhouse: {len(keep) + 1} wheels in {out} ({size / 2**20:.1f} MiB) for "
        f"{'Python ' + a.python_version if a.python_version else 'this Python'}"
        f"{' on ' + ', '.join(platforms) if platforms else ''}"
    )
    for name, ver, why in sorted(left):
        print(f"  left out: {name} {ver} ({why})")


if __name__ == "__main__":
    sys.exit(main())
