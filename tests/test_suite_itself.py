"""The suite's own promises (conftest.py): one session seed that reproduces every random case,
said in the header, under each failure and at the end; and a run that writes nothing of the
user's (its caches live in a session directory, removed at the end). Checked on a throwaway
test file run by a child pytest with this conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
import os, random
import torch
from hypothesis import given, strategies as st


@given(st.integers())
def test_hypothesis_writes_nothing_here(x):  # its example database and constants cache
    assert int(str(x)) == x

def test_draws(tmp_path_factory):
    print("DRAW", torch.rand(1).item(), random.random())
    print("ENV", os.environ["TREEATTN_CACHE"], os.environ["XDG_CACHE_HOME"], os.environ["TRITON_CACHE_DIR"])
    assert False, "planted"
'''


def _run(d: Path, seed: str) -> str:
    env = {**os.environ, "TREEATTN_TEST_SEED": seed}
    for k in (
        "TREEATTN_CACHE",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "TRITON_HOME",
        "TRITON_CACHE_DIR",
        "HYPOTHESIS_STORAGE_DIRECTORY",
        "PYTEST_ADDOPTS",
    ):
        env.pop(k, None)  # as a user's shell has them: unset
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_one_seed_reproduces_a_failing_random_case_and_nothing_of_the_user_is_written(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    a = _run(tmp_path, "1234")
    drew = next(x[x.index("DRAW") :] for x in a.splitlines() if "DRAW" in x).split()[1:]

    def expect(session_seed):  # what the test's generators give from crc32(session seed, test id)
        import random
        import zlib

        import torch

        s = zlib.crc32(f"{session_seed}:test_probe.py::test_draws".encode())
        torch.manual_seed(s)
        random.seed(s)
        return [repr(torch.rand(1).item()), repr(random.random())]

    assert drew == expect(1234) != expect(99)  # the seed decides the draws, and it is the test's own
    assert "TREEATTN_TEST_SEED=1234 pytest 'test_probe.py::test_draws'" in a  # under the failure
    tail = a[a.index("short test summary") :] if "short test summary" in a else a
    assert "treeattn: session seed 1234" in a[a.index("FAILURES") :] and "1 failed" in tail  # and at the end
    env = next(x for x in a.splitlines() if x.startswith("ENV")).split()[1:]  # after DRAW's line
    home = str(Path.home())
    assert all(not p.startswith(home) for p in env), env  # nothing under the user's home
    assert not any(Path(p).exists() for p in env)  # the session directory is gone
    assert not (tmp_path / ".hypothesis").exists()


def test_every_mutant_still_applies():
    """tools/mutants.py plants each defect by replacing a string that must occur exactly once in
    its file: code that moved on leaves a mutant that cannot apply (three had, unnoticed, since
    the mutation check is not in CI). Checked here, where it costs nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import mutants

    root = Path(__file__).resolve().parents[1]
    stale = [
        (m.name, (root / m.file).read_text().count(m.old))
        for m in mutants.MUTANTS
        if (root / m.file).read_text().count(m.old) != 1
    ]
    assert not stale, f"mutants whose text no longer occurs exactly once: {stale}"
