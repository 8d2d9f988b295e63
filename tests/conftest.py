"""Test setup: the Triton interpreter on machines without a GPU (set before triton is imported),
one reproducible session seed, and a run that touches nothing of the user's.

* Randomness: one session seed (``TREEATTN_TEST_SEED`` overrides it), printed in pytest's header
  and under every failure; each test's torch and ``random`` generators are seeded from it and
  the test's id (the ``seed`` fixture), so a failing random case re-runs with the same inputs:
  ``TREEATTN_TEST_SEED=<seed> pytest '<test id>'``.
* Isolation: ``TREEATTN_CACHE`` points at a directory of this session (kernel verdicts, model
  probes, the converted demo model: made once per session), so a stale verdict in the user's
  cache can never send the tests down another path, and the user's cache is never written;
  so do ``XDG_CACHE_HOME``, ``HF_HOME`` and Triton's home and cache, and Hypothesis keeps its
  examples there, not in the working directory. The directory is removed at the end.
* ``--reverse``: run the collected tests in reverse order (order independence).
"""

import os
import random
import signal
import shutil
import tempfile
import zlib

import pytest

import treeattn_cli  # noqa: F401  (before torch computes anything: MKL's strict mode, treeattn_cli/__init__.py)
import torch
from treeattn_cli.parallel import forkserver

forkserver.MANY_LAUNCHES["on"] = True  # the suite starts ranks hundreds of times from this process

# A run started in the background (`make test &`, nohup, some CI runners) inherits SIGINT
# ignored, as POSIX shells set for asynchronous jobs, and passes that on to the processes the
# signal tests start, which then cannot be interrupted at all. A terminal's foreground job has
# the default disposition: give it back (a handler here becomes SIG_DFL in children on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = int(os.environ.get("TREEATTN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# Everything the session writes outside its tests' tmp_path: set before any rank is started
# (they inherit the environment), removed at the end.
_SESSION_DIR = tempfile.mkdtemp(prefix="treeattn-tests-")
os.environ["TREEATTN_CACHE"] = os.path.join(_SESSION_DIR, "cache")
# and every other cache a library would keep in the user's home (~/.cache, ~/.triton)
os.environ["XDG_CACHE_HOME"] = os.path.join(_SESSION_DIR, "xdg")
os.environ["HF_HOME"] = os.path.join(_SESSION_DIR, "hf")
os.environ["TRITON_HOME"] = os.path.join(_SESSION_DIR, "triton")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_SESSION_DIR, "triton", "cache")
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(_SESSION_DIR, "hypothesis")  # its constants cache too
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

try:
    from hypothesis import settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    settings.register_profile("treeattn", database=DirectoryBasedExampleDatabase(os.path.join(_SESSION_DIR, "hyp")))
    settings.load_profile("treeattn")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if getattr(config.option, "hypothesis_seed", None) is None and hasattr(config.option, "hypothesis_seed"):
        config.option.hypothesis_seed = SESSION_SEED  # Hypothesis draws from the session seed too


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true", help="run the tests in reverse order (order independence)")


def pytest_report_header(config):
    return [
        f"treeattn: session seed {SESSION_SEED} (TREEATTN_TEST_SEED={SESSION_SEED} reproduces it); "
        f"TREEATTN_CACHE={os.environ['TREEATTN_CACHE']}"
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end (``-q`` hides the header): a failing run says how to repeat it."""
    terminalreporter.write_line(
        f"treeattn: session seed {SESSION_SEED} (TREEATTN_TEST_SEED={SESSION_SEED} "
        f"reproduces every random case of this run)"
    )


def _registry() -> dict:
    """``helpers.EARLY``, or nothing where this conftest runs without this suite's helpers (the
    suite's own test copies it into a bare folder)."""
    try:
        from helpers import EARLY
    except ImportError:
        return {}
    return EARLY


def _early(item) -> list[str]:
    """The fixtures of ``item`` that wait for work started at collection (``helpers.EARLY``)."""
    return [
        f
        for f, (module, _) in _registry().items()
        if item.nodeid.startswith(module) and f in getattr(item, "fixturenames", ())
    ]


def pytest_collection_modifyitems(config, items):
    # last, so that the work started for them at collection has the whole run to finish in
    items.sort(key=lambda item: bool(_early(item)))
    if config.getoption("--reverse"):
        items.reverse()
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Work a later module needs, started now at the lowest priority (``helpers.Background``):
    the offline compile and the offline install, when any of their tests is selected."""
    if session.config.option.collectonly:
        return
    from pathlib import Path

    for fixture in sorted({f for i in session.items for f in _early(i)}):
        _registry()[fixture][1](Path(_SESSION_DIR))


def pytest_unconfigure(config):
    try:
        from helpers import Background
    except ImportError:
        Background = None
    if Background is not None:
        Background.stop_all()
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


def seed_of(nodeid: str) -> int:
    """The seed of the test ``nodeid`` in this session."""
    return zlib.crc32(f"{SESSION_SEED}:{nodeid}".encode())


@pytest.fixture(autouse=True)
def seed(request):
    """This test's seed (torch's and ``random``'s generators start from it)."""
    s = seed_of(request.node.nodeid)
    torch.manual_seed(s)
    random.seed(s)
    return s


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        rep.sections.append(
            (
                "treeattn seed",
                f"session seed {SESSION_SEED}, this test's {seed_of(item.nodeid)}: "
                f"TREEATTN_TEST_SEED={SESSION_SEED} pytest '{item.nodeid}'",
            )
        )


# ---------------------------------------------------------------- shared fixtures


class TinyModels:
    """Tiny random models saved once per session and shared by every test module (building one
    costs ~0.3 s and its greedy oracle more): ``tiny(kind, seed=, **config)`` -> its directory."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def __call__(self, kind: str, seed: int = 0, **over):
        from treeattn_cli.verify import tiny as tiny_models

        key = (kind, seed, tuple(sorted(over.items())))
        if key not in self.made:
            name = f"{kind}-{seed}" + "".join(f"-{k}{v}" for k, v in sorted(over.items()))
            self.made[key] = tiny_models.make_model(kind, self.root / name, seed=seed, **over)
        return self.made[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(kind, seed=0, **config)``: a tiny random model's directory, made once per session
    (tests must not change it: copy it to tmp_path first)."""
    return TinyModels(tmp_path_factory.mktemp("tiny"))
