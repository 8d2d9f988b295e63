"""The fork server local ranks are forked from, and the few launcher facts needed before torch.

Nothing here imports torch: a command starts the server (:func:`warm_early`) before its own
imports, so the server's imports (torch, transformers, the engine: seconds) overlap the
launcher's (torch, the tokenizer, the prompt, the model's files) from the first moment instead
of after the launcher's torch import. ``launch.py`` runs the ranks on it."""

from __future__ import annotations

import contextlib
import os
import signal

# What a rank imports before it joins its group: torch, the transformers modules a model loads
# with (transformers imports lazily), and the engine. The fork server of local ranks imports them
# once (``context``); a torchrun rank imports them before ``init_process_group``
# (``launch.run_torchrun``). Some of them (torch's FSDP and sharded-tensor modules, pulled in
# by ``transformers.modeling_utils``) take ``group.WORLD`` as a default argument when first
# imported: imported after the group exists, they hold the default group forever, so leaving the
# group cannot stop its threads, and a thread of gloo's still freeing the last collective's work at
# interpreter exit aborts the process ("terminate called without an active exception").
RANK_IMPORTS = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.distributed",
    "treeattn_cli.engine.engine",
    "treeattn_cli.engine.job",
)


# A launcher that will start ranks many times (``treeattn check``, the test suite) has its fork
# server do the first model load's once-per-process work too (``model/preload.py``): ~0.25 s a rank
# each launch, against ~0.5 s more before the first (a command that launches once would lose).
MANY_LAUNCHES = {"on": False}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def context():
    """Rank processes come from a fork server that imported torch and transformers once, so a
    launch costs a fork per rank instead of a fresh interpreter and its imports (and the server
    is kept for later launches from the same process). ``transformers`` imports lazily: the
    modules a rank loads a model with are named in ``RANK_IMPORTS``, or every rank would import
    them again (~5 s of a 2-core machine's time per launch, against ~1 s of work for a tiny
    model). CUDA is never initialised before the fork: the server only imports."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "treeattn_cli.parallel.forkserver_init",
            *RANK_IMPORTS,
            *(["treeattn_cli.model.preload"] if MANY_LAUNCHES["on"] else []),
        ]
    )
    return ctx


def warm() -> None:
    """Start the ranks' fork server from this thread (call from the main thread before running
    ranks from another one: the server dies with the thread that started it)."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


def warm_early() -> None:
    """Start the ranks' fork server as a command begins, before this process imports torch, so
    that its imports (torch and transformers, ~5 s of a 2-core machine) overlap the launcher's
    own instead of following them; it is ended when this process exits. A server still importing
    would otherwise outlive a command that failed before any rank ran by seconds, holding the
    command's standard output and error open (``treeattn ... | cat`` and a caller capturing the
    output would wait for it)."""
    import atexit

    warm()
    if _end not in _AT_EXIT:
        _AT_EXIT.append(_end)
        atexit.register(_end)


_AT_EXIT: list = []


def _end() -> None:
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # its ranks have ended: this process is leaving
            os.waitpid(pid, 0)  # gone, its copies of our stdout and stderr closed, before we are
