"""Start N local ranks (or join torchrun's group) and tear them down.

Local runs: the launching process hosts the rendezvous store on 127.0.0.1 (a port the OS picks,
so a busy port is never a problem) and spawns one process per rank. Each rank joins the group
through :func:`comm.init_process_group` with the collective timeout, runs ``fn(ctx, *args)`` and
sends its result back. The launcher outlives the ranks: it sees a rank that dies (even by
SIGKILL), names it, and stops the others.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import queue as queue_mod
import signal
import threading
import time
import traceback
from dataclasses import dataclass

from . import comm
from .forkserver import RANK_IMPORTS, context

LOCALHOST = "127.0.0.1"


class LaunchError(RuntimeError):
    """A rank failed; the message names it and says why. ``outcomes[r]`` is rank r's
    ``(kind, value)``: ``("ok", result)``, ``("error", (message, traceback))`` for the rank
    that failed first-hand, ``("lost", ...)`` for ranks that failed because of it."""

    def __init__(self, message, outcomes=None):
        super().__init__(message)
        self.outcomes = outcomes or {}


@dataclass
class RankContext:
    """What a rank's function receives: who it is and where it runs."""

    rank: int
    world: int
    local_rank: int
    backend: str
    device: str  # "cpu" or "cuda:N"
    timeout_s: float
    emit: object = None  # emit(kind, payload): an event for the launcher's presentation

    def send(self, kind: str, payload=None) -> None:
        if self.emit is not None:
            self.emit(kind, payload)


class Stopped(LaunchError):
    """The caller stopped the ranks (``run_local``'s ``abort``)."""


class Terminated(KeyboardInterrupt):
    """The launcher received SIGTERM (Slurm, Kubernetes, systemd, ``timeout``): handled like
    Ctrl-C, with its own exit status (143)."""


def die_with_parent(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere a
    no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _rank_main(fn, rank, world, port, backend, device, timeout_s, args, results, launcher):
    import torch

    # Ctrl-C and SIGTERM go to the whole process group (terminal, `timeout`, Slurm): the launcher
    # alone handles them and stops the ranks. A rank dies with its fork server, which dies with
    # the launcher (forkserver_init.py): a launcher killed outright leaves no orphan holding a
    # GPU. Local ranks talk over loopback only.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1`: its stacks, as the launcher's
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    die_with_parent(signal.SIGKILL)
    if not alive(launcher):  # it died before the line above took effect
        os._exit(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world)) if device == "cpu" else None
    ctx = RankContext(
        rank,
        world,
        rank,
        backend,
        device,
        timeout_s,
        emit=lambda kind, payload: results.put((rank, "event", (kind, payload))),
    )
    try:
        store = comm.make_store(port, world + 1, host=LOCALHOST, is_master=False, timeout_s=timeout_s)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        comm.init_process_group(backend, rank, world, store, timeout_s, device=dev)
        out = fn(ctx, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        comm.report_failure(e)
        kind = "lost" if isinstance(e, comm.RankFailure) else "error"
        results.put((rank, kind, (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        comm.destroy_process_group()


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM wait while the ranks are started: a signal between the fork server's
    fork and ``Process.start`` returning would leave a rank this process cannot name, and an
    exit then unlinks the result queue's semaphores before that rank has read them (it dies
    printing a traceback). A held signal is handed to its own handler when the block ends,
    inside ``run_local``'s clean-up. Held in Python, not by the thread's signal mask: the
    kernel would hand a masked signal to any other thread (torch's, the queue's)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only: nothing arrives here
        return
    held: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in before:
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            if callable(before[s]):
                before[s](s, None)  # raises KeyboardInterrupt, Terminated, ...
            elif before[s] == signal.SIG_DFL:
                signal.raise_signal(s)


def run_local(
    fn,
    nproc: int,
    *args,
    backend: str = "gloo",
    devices=None,
    timeout_s: float = 300.0,
    grace_s: float = 5.0,
    on_event=None,
    on_start=None,
    abort=None,
):
    """Run ``fn(ctx, *args)`` on ``nproc`` fresh local ranks; returns the per-rank results.

    ``devices``: one device string per rank (default all "cpu"). ``on_event(rank, kind,
    payload)`` receives what ranks ``ctx.send``, in the launching process, as it comes.
    ``on_start(store)``: called once the ranks run, with the rendezvous store this process
    hosts (``chat`` posts its requests there). ``abort``: a ``threading.Event``; when set, the
    ranks are stopped at once and :class:`Stopped` is raised (for a caller that runs this in a
    thread while its main thread owns the terminal and the signals).
    Raises :class:`LaunchError` naming the first rank that failed (its own error, not the
    others' reaction to it).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    devices = devices or ["cpu"] * nproc
    store = comm.make_store(0, nproc + 1, host=LOCALHOST, is_master=True, timeout_s=timeout_s)
    ctx = context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            name=f"treeattn-rank{r}",
            daemon=True,
            args=(fn, r, nproc, store.port, backend, devices[r], timeout_s, args, results, os.getpid()),
        )
        for r in range(nproc)
    ]
    got: dict[int, tuple] = {}
    first_error = None
    dead_since = None
    interrupted = False
    looked = time.monotonic()  # when the ranks' heartbeats were last read
    try:
        with _signals_held():
            for p in procs:
                p.start()
        if on_start is not None:
            on_start(store)
        while len(got) < nproc:
            if abort is not None and abort.is_set():
                interrupted = True
                break
            try:
                rank, kind, val = results.get(timeout=0.2)
                if kind == "event":
                    if on_event is not None:
                        on_event(rank, *val)
                    continue
                got[rank] = (kind, val)
                if kind == "error" and first_error is None:
                    first_error = f"rank {rank} failed: {val[0]}"
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that died without reporting (SIGKILL, OOM)
                if r not in got and not p.is_alive() and p.exitcode is not None:
                    if p.exitcode < 0:
                        why = f"killed by {signal.Signals(-p.exitcode).name}"
                    else:
                        why = f"exited with code {p.exitcode}"
                    got[r] = ("error", (f"rank {r} {why}", ""))
                    first_error = first_error or f"rank {r} {why}"
            if first_error is None and time.monotonic() - looked > 1.0:  # a rank stopped (SIGSTOP, a
                looked = time.monotonic()  # frozen host) beats no more: past the timeout it is lost
                for r in comm.silent_ranks(store, nproc, timeout_s):
                    if r not in got:
                        procs[r].kill()  # (SIGKILL: a stopped process ends too)
                        got[r] = (
                            "error",
                            (f"rank {r} stopped responding (no heartbeat for {timeout_s:g} s, --timeout): killed", ""),
                        )
                        first_error = first_error or got[r][1][0]
            if first_error and dead_since is None:
                dead_since = time.monotonic()
            if dead_since is not None and time.monotonic() - dead_since > grace_s:
                # A rank failed first-hand: the survivors get a moment to report how they
                # noticed, then are stopped. Under NCCL they would sit in a collective that
                # never completes until its timeout (minutes) before noticing themselves.
                break
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(timeout=0 if interrupted else grace_s if first_error is None else 0.5)
        for p in started:  # ranks ignore SIGTERM (see _rank_main): stop what is left at once
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(2)
        results.close()
        del store  # its server closes the listening socket
    if interrupted:
        raise Stopped("stopped", got)
    if first_error is None:
        first_error = next((f"rank {r}: {got[r][1][0]}" for r in sorted(got) if got[r][0] != "ok"), None)
    if first_error is None and len(got) < nproc:
        first_error = f"ranks {sorted(set(range(nproc)) - set(got))} did not finish"
    if first_error is not None:
        raise LaunchError(first_error, got)
    return [got[r][1] for r in range(nproc)]


def run_torchrun(fn, *args, backend: str = "gloo", device: str = "cpu", timeout_s: float = 300.0, on_event=None):
    """Run ``fn(ctx, *args)`` as this process's rank of a torchrun job (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT set by torchrun). Rank 0's events go to ``on_event`` here."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    emit = (lambda kind, payload: on_event(rank, kind, payload)) if on_event else None
    ctx = RankContext(rank, world, local, backend, device, timeout_s, emit=emit)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    for name in RANK_IMPORTS:  # before the group exists: see RANK_IMPORTS
        importlib.import_module(name)
    try:
        comm.init_process_group(backend, rank, world, None, timeout_s, device=dev)
        return fn(ctx, *args)
    except BaseException as e:
        comm.report_failure(e)
        raise
    finally:
        comm.destroy_process_group()
