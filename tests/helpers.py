"""Shared test helpers: tolerances, oracles, the CLI in-process, usage errors, memory, and the
processes a run leaves (for the tests that start the console script)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

# Named tolerances (docs/architecture.md §7): relative to the output scale.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float64: 1e-12}


def attention_f64(q, k, v, *, scale=None, mask=None, softcap=None):
    """Float64 softmax attention oracle with an explicit repeat of KV heads.

    q [B, H, Q, d], k/v [B, H_kv, N, d], mask [B, Q, N] bool or None.
    Returns (o [B, H, Q, d] f64, lse [B, H, Q] f64), o = 0 / lse = -inf for rows with no key.
    """
    B, H, Q, d = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(G, dim=1)
    vv = v.double().repeat_interleave(G, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale  # (B, H, Q, N)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ vv, lse


def assert_close(actual, expected, dtype, what=""):
    """|actual - expected| <= tol * max(1, max|expected|) elementwise, NaN-free, same -inf."""
    a, e = actual.double(), expected.double()
    assert not torch.isnan(a).any(), f"{what}: NaN in output"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e), f"{what}: -inf pattern differs"
    a, e = a.masked_fill(inf_a, 0), e.masked_fill(inf_e, 0)
    scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


def cli(*args: str, input: str | None = None):
    """Run ``treeattn *args`` in this process (no fresh interpreter and its seconds of imports);
    returns click's result: ``exit_code``, ``stdout``, ``stderr``. The console script itself is
    exercised by the tests that need a process (signals, process trees, torchrun)."""
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    return CliRunner().invoke(app, list(args), input=input)


def assert_usage_error(r, needle: str, code: int = 2) -> None:
    """Bad input: exit status 2 (or ``code``), exactly one line on stderr naming it, nothing on
    stdout. ``r``: click's result (:func:`cli`) or a finished ``subprocess.run``."""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    status = r.exit_code if hasattr(r, "exit_code") else r.returncode
    assert status == code, (status, r.stderr, getattr(r, "exception", None))
    assert len(lines) == 1 and lines[0].startswith("treeattn: error:") and needle in lines[0], r.stderr
    assert r.stdout == "", r.stdout


def anon_bytes() -> int:
    """This process's anonymous resident memory (file-backed pages, e.g. mmap'd checkpoints, do
    not count: they are the page cache)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) * 1024
    return 0


def peak_anon_growth(fn, probes=()):
    """``(result of fn(), peak growth of anonymous memory while it ran)``. Measured at events:
    ``probes`` is a list of ``(object, attribute)`` whose callables are wrapped while ``fn`` runs
    to read the memory as each call begins and ends (and, for a call that returns a callable
    such as a generator of pieces, at each item it yields); a thread also samples every few ms,
    as a backstop between events."""
    import threading

    base, peak, stop = anon_bytes(), [0], threading.Event()

    def sample():
        peak[0] = max(peak[0], anon_bytes())

    def sampled_gen(gen_fn):
        def pieces(*a, **kw):
            for x in gen_fn(*a, **kw):
                sample()
                yield x
            sample()

        return pieces

    def wrap(real):
        def probe(*a, **kw):
            sample()
            out = real(*a, **kw)
            sample()
            return sampled_gen(out) if callable(out) else out

        return probe

    saved = [(obj, name, getattr(obj, name)) for obj, name in probes]
    for obj, name, real in saved:
        setattr(obj, name, wrap(real))

    def watch():
        while not stop.wait(0.002):
            sample()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
        for obj, name, real in saved:
            setattr(obj, name, real)
    sample()
    return out, peak[0] - base


# ---------------------------------------------------------------- processes


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rank_pids(launcher_pid: int) -> list[int]:
    """Rank processes: the children of the launcher's fork server, in rank order (pid order)."""
    server = [p for p in descendants(launcher_pid) if "forkserver" in cmdline(p)]
    kids = []
    for s in server:
        kids += [int(k) for k in Path(f"/proc/{s}/task/{s}/children").read_text().split()]
    return sorted(kids)


def kernel_view(pids) -> str:
    """What the kernel says each thread of ``pids`` is doing: its name, state, the call it
    waits in and (where readable) its kernel stack. It explains a hang that Python's own
    stacks cannot: a process past its interpreter's finalization prints none."""
    lines = []
    for pid in pids:
        lines.append(f"process {pid}: {cmdline(pid)[:120]}")
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            lines.append("  (gone)")
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            read = lambda name: _read(f"{base}/{name}")  # noqa: E731
            stat = read("stat")
            state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
            stack = " < ".join(ln.split()[-1] for ln in read("stack").splitlines()[:6])
            lines.append(
                f"  {tid} {read('comm').strip()!r} {state} wchan={read('wchan').strip() or '-'}"
                + (f" stack: {stack}" if stack else "")
            )
    return "\n".join(lines)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or one gone between two reads of /proc, does not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except (FileNotFoundError, ProcessLookupError):
        return False


def still_running(pids, within=10.0):
    """Wait until none of ``pids`` runs (zombies count as gone); returns those still running."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


# ---------------------------------------------------------------- drafting premises


def copying_question(model_dir, doc: list[int], *, kv_round=None, tries: int = 64) -> list[int]:
    """A question whose greedy answer after ``doc`` repeats an earlier bigram at once, so that
    n-gram drafting drafts at its first verify and greedy keeps the draft: the premise of a test
    about drafting, found with transformers' greedy decode (as the tests' oracle) rather than
    hoped of a random model. Candidates: a token and the model's own greedy words after it
    (random models fall into loops). Fails the test, loudly, if none of ``tries`` qualifies."""
    import pytest

    from treeattn_cli.engine.speculate import Drafter
    from treeattn_cli.verify.tiny import greedy_decoder

    greedy = greedy_decoder(model_dir, kv_round)

    for x in range(tries):
        start = [(37 * x + 11) % 230 + 20]
        q = start + greedy(doc + start, 6)
        first, second = greedy(doc + q, 2)
        if Drafter(doc + q + [first]).draft(1) == [second]:
            return q
    pytest.fail(f"no question of {tries} makes {model_dir}'s greedy answer copy a bigram (the drafting premise)")


def stop_string_in(text: str, ids: list[int], decode, start: int = 2) -> tuple[str, int]:
    """A stop string taken from an answer (``text``, its token ``ids``): the first two printable
    ASCII characters at or after ``start`` (else before it) that occur there first, and ``n``,
    the tokens after which the answer holds it (where a stop must end it). Asserts there is one."""
    for i in [*range(start, len(text) - 1), *range(min(start, len(text) - 1))]:
        s = text[i : i + 2]
        if s.isascii() and s.isprintable() and text.find(s) == i:
            n = next(k for k in range(1, len(ids) + 1) if s in decode(ids[:k]))
            return s, n
    raise AssertionError(f"no stop string to take from {text!r}")


# ---------------------------------------------------------------- work started early


class Background:
    """Subprocesses started when the session is collected, at the lowest CPU priority, and
    collected by the fixture that needs their output: the offline compile (~650 CPU-seconds on
    CI's 2 cores) then uses the CPU the tests before it leave idle instead of holding up the
    suite. Output goes to files (a pipe nobody reads would fill and stop the process)."""

    jobs: dict = {}

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict, root: Path, nice: int = 19) -> None:
        import os
        import subprocess

        root.mkdir(parents=True, exist_ok=True)
        out, err = open(root / f"{name}.out", "w+"), open(root / f"{name}.err", "w+")
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True, preexec_fn=lambda: os.nice(nice))
        cls.jobs[name] = (proc, out, err)

    @classmethod
    def result(cls, name: str, timeout: float) -> tuple[str, str] | None:
        """``(stdout, stderr)`` of the finished job ``name``, or None when it was never started."""
        if name not in cls.jobs:
            return None
        proc, out, err = cls.jobs.pop(name)
        proc.wait(timeout=timeout)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return texts[0], texts[1]

    @classmethod
    def stop_all(cls) -> None:
        for proc, out, err in cls.jobs.values():
            proc.kill()
            proc.wait()
            out.close()
            err.close()
        cls.jobs.clear()


OFFLINE_TARGETS = ("sm_80", "sm_90", "gfx942")


def start_offline_install(root: Path) -> None:
    """``make wheelhouse`` into ``root``, then a fresh venv with only torch and Triton installs
    ``treeattn[test,serve]`` from it with ``--no-index`` and runs ``gpu_report --preflight``
    (``treeattn_cli.bench.wheelhouse --check-install``): issue 34's done-when, ~75 s of a
    2-core machine, needs the package index for the build only."""
    import os
    import sys

    if "offline-install" in Background.jobs:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    Background.start(
        "offline-install",
        [sys.executable, "-m", "treeattn_cli.bench.wheelhouse", "--out", str(root / "wheelhouse"), "--check-install"],
        env,
        root,
    )


# Work a test module's fixture waits for, started when the session is collected: fixture name ->
# (the module whose tests use it, what starts it).
EARLY = {
    "compiled": ("tests/kernel/test_offline_compile.py::", lambda root: start_offline_compiles(root / "offline")),
    "offline_install": ("tests/test_packaging.py::", lambda root: start_offline_install(root / "install")),
}


def start_offline_compiles(root: Path) -> None:
    """The three targets' offline compiles (``treeattn_kernels.offline_compile``), each in its own
    single-threaded process with a cold Triton cache (the compiler really runs)."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("triton") is None:
        return  # the module skips itself
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for t in OFFLINE_TARGETS:
        if f"compile-{t}" in Background.jobs:
            continue
        cache = root / f"triton-{t}"
        Background.start(
            f"compile-{t}",
            [sys.executable, "-m", "treeattn_kernels.offline_compile", "--target", t, "--json"],
            {**env, "TRITON_CACHE_DIR": str(cache)},
            root,
        )


def begin_step(tail, positions, active=None):
    """Start a decode step on a ``PagedTail`` as the engine's runner does: ``plan_step`` on the
    host, then ``start_step`` with the step's store and positions on the device; returns
    ``store [B] bool`` (host)."""
    import torch

    store = tail.plan_step(active)
    tail.start_step(
        store,
        store.to(torch.int64).to(tail.device),
        torch.as_tensor(positions, dtype=torch.int64).expand(tail.batch).to(tail.device),
    )
    return store
