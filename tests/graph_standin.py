"""A stand-in for CUDA graphs on CPU ranks (``treeattn_cli.engine.graphs.backend``).

A CUDA graph replays what ran while it was captured: the same operations, on the same buffers,
with the same sizes and the same host numbers baked in. A step is right to capture only if
running it eagerly at any later replay would issue exactly that. The stand-in checks it: the
capture runs the step and records every operation it dispatches (its name; for each tensor it
reads that the step did not make, the storage, offset, shape, strides and dtype; for a tensor the
step made, its shape and dtype; every other argument as is). A replay runs the step again,
records it the same way, and raises if anything differs: a step that read a buffer a graph
would not see (a new document's cache, a grown one, a staging buffer used in turn), or took a
host number that changed (a length, a row count) into a size, fails here as it would misbehave
on a GPU. A capture that reads the device (``.item()``, ``int(t)``, ``bool(t)``) fails, as CUDA
refuses it. The replay's output is copied into the capture's, as a graph's would land there.

``fail``: ``"capture"`` makes the capture fail on rank 1 (after the step ran: collectives
matched); ``"warmup"`` makes rank 1 fail in its warm-up run.
"""

from __future__ import annotations

import sys

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where: list = []  # each operation's innermost caller in treeattn (for the message)
        self.ops: list = []
        self.made: set = set()  # storages the run made (intermediates: a graph's own memory)
        self.read: set = set()  # storages it read before making anything in them

    def _sig(self, a):
        if isinstance(a, torch.Tensor):
            p = a.untyped_storage().data_ptr()
            if p in self.made:
                return ("made", tuple(a.shape), a.dtype)
            self.read.add(p)
            return ("buffer", p, a.storage_offset(), tuple(a.shape), tuple(a.stride()), a.dtype)
        if isinstance(
            a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
        ):
            return a
        return type(a).__name__

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sig = tuple(self._sig(a) for a in pytree.tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                p = t.untyped_storage().data_ptr()
                if p not in self.read:
                    self.made.add(p)
        f = sys._getframe(1)
        while f is not None and "treeattn_cli" not in f.f_code.co_filename:
            f = f.f_back
        self.where.append(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno}" if f else "?")
        self.ops.append((str(func), sig))
        return out


def _run_traced(fn):
    with _Trace() as tr:
        out = fn()
    return out, tr.ops, tr.where


class Graph:
    def __init__(self, fn, ops, out, where):
        self.fn, self.ops, self.out, self.where = fn, ops, out, where


class StandIn:
    """The graph backend's three calls (``graphs.CudaBackend``), on the CPU, with the check."""

    def __init__(self, rank: int, fail: str | None = None):
        self.rank, self.fail = rank, fail
        self.checked = 0  # replays compared with their capture

    def warm_up(self, fn, device):
        if self.fail == "warmup" and self.rank == 1:
            raise RuntimeError("CUDA out of memory (simulated, in the warm-up)")
        fn()

    def capture(self, fn, device):
        out, ops, where = _run_traced(fn)
        if self.fail == "capture" and self.rank == 1:
            raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        read = next((i for i, (op, _) in enumerate(ops) if "_local_scalar_dense" in op), None)
        if read is not None:  # a capture cannot wait for the device: CUDA refuses the step
            raise RuntimeError(
                f"operation not permitted when stream is capturing: the step reads the device "
                f"({ops[read][0]} at {where[read]}, simulated)"
            )
        return Graph(fn, ops, out, where), out

    def replay(self, g) -> None:
        out, ops, where = _run_traced(g.fn)
        if ops != g.ops:
            i = next((i for i, (a, b) in enumerate(zip(ops, g.ops)) if a != b), min(len(ops), len(g.ops)))
            got = ops[i] if i < len(ops) else "nothing"
            want = g.ops[i] if i < len(g.ops) else "nothing"
            at = f"{g.where[i] if i < len(g.where) else '-'} / {where[i] if i < len(where) else '-'}"
            raise AssertionError(
                f"a replay would differ from its capture at operation {i} of {len(g.ops)} "
                f"({at}): captured {want}, the step now runs {got}"
            )
        if out is not None:
            g.out.copy_(out)
        self.checked += 1


def install(rank: int, fail: str | None = None) -> StandIn:
    """Put a stand-in in as this process's graph backend; returns it (``checked`` counts replays)."""
    from treeattn_cli.engine import graphs

    graphs.backend = StandIn(rank, fail)
    return graphs.backend
