"""Decode steps replayed as CUDA graphs (issue 38): one capture per shape, one replay per step.

A step at small batch is bound by the host (per layer a few kernel launches, a collective and
tens of small torch ops, each with its Python): replaying a captured graph issues all of it in
one launch. A graph replays exactly what ran while it was captured: the same kernels on the same
buffers with the same sizes. So everything a captured step reads comes from buffers that outlive
it (the caches, the static inputs a step copies its values into) and everything the host decided
while capturing (which rows read which document, how long each view is, the tail's capacity) is
part of the graph's *key*: a step whose key has no graph yet is captured first.

:class:`StepGraphs` keeps the graphs of one kind of step by key and owns the protocol every
capture follows (a single answer's step and verify, ``decode.Decoder``, and a batch's step and
verify, ``batch.BatchDecoder``): a warm-up run on a side stream (every rank runs it, so their collectives
match; a step's writes are idempotent: the same slots get the same values), the capture, and the
agreement across every rank of the world that it worked. If any rank's capture fails, every rank
runs that kind of step eagerly from then on and says why once (a graph and eager steps of one
kind never mix, and a rank never waits in a collective its peers skip). The warm-up runs the
collectives for real: a rank that fails inside it (out of memory) leaves its peers in a
collective no agreement can reach, so that failure is raised like any other step's.

The backend (CUDA here) is one object, :data:`backend`: tests on CPU ranks put a stand-in there
that runs the step and checks each replay would issue what the capture recorded
(``tests/graph_standin.py``).
"""

from __future__ import annotations

import itertools

from collections import OrderedDict

import torch

SERIALS = itertools.count(1)  # each KV holder's own number (a CUDA graph's key: ids are reused)


class CudaBackend:
    """CUDA graphs, every capture of a process in one memory pool (graphs of one process replay
    one at a time, so their intermediates may share memory)."""

    def __init__(self):
        self.pool = None

    def warm_up(self, fn, device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)

    def capture(self, fn, device):
        """``(graph, out)``: ``fn``'s work recorded, and the output the replays write into."""
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool):
                out = fn()
        except Exception:
            heal_rng(device)
            raise
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def replay(self, g) -> None:
        g.replay()


def heal_rng(device) -> bool:
    """After a failed capture: leave the device's random generator usable. A capture that fails
    inside ``torch.cuda.graph`` can end before torch's generator leaves its capture state, and
    every later random op of the process then raises "Offset increment outside graph capture
    encountered unexpectedly" (seen on an H100, torch 2.11: ``bench.gpu_decode`` after a failed
    capture). An empty capture runs the generator's prologue and epilogue again. Returns whether
    the generator works now."""
    try:
        torch.empty(1, device=device).uniform_()
        return True
    except RuntimeError:
        pass
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except Exception:  # noqa: BLE001 - best effort; the probe below says whether it worked
        pass
    try:
        torch.empty(1, device=device).uniform_()
        return True
    except RuntimeError:
        return False


backend = None  # the process's backend: made on first use (CudaBackend), or a test's stand-in


def _backend():
    global backend
    if backend is None:
        backend = CudaBackend()
    return backend


class StepGraphs:
    """The captured graphs of one kind of step, by key (at most ``limit``, the least recently
    replayed dropped first). ``world``: every rank that must agree on a capture (tensor-parallel
    peers too, not only the sequence shards). ``on`` turns False for good when a capture fails
    on any rank; ``note`` says why."""

    def __init__(self, device, world, *, what: str = "decode step", limit: int = 8):
        self.device, self.world, self.what, self.limit = device, world, what, limit
        self.on = True
        self.note: str | None = None
        self.captures = self.replays = 0
        self._graphs: OrderedDict = OrderedDict()  # key -> (graph, its output, its input buffers)

    @property
    def held(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def run(self, key, inputs: list, fn, eager):
        """This step's output: ``fn(*static)`` replayed from the graph of ``key`` (captured first
        if it has none), where ``static`` are the graph's own buffers shaped like ``inputs`` (the
        step's device tensors, copied in before the replay; their shapes join the key). When a
        capture fails on any rank, ``eager()`` runs instead, and does from then on (``on`` is
        False). ``fn`` reads nothing else that does not outlive the step; it returns a tensor or
        None (the replays write the same tensor)."""
        key = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        entry = self._graphs.get(key)
        if entry is None:
            be = _backend()
            while len(self._graphs) >= self.limit:
                self._graphs.popitem(last=False)
            static = [t.clone() for t in inputs]
            be.warm_up(lambda: fn(*static), self.device)
            err = None
            try:
                g, out = be.capture(lambda: fn(*static), self.device)
            except Exception as e:  # noqa: BLE001 - any capture problem: run eagerly, say why
                err = f"{type(e).__name__}: {e}"
            if not self.world.all_true(err is None):
                self.on = False
                self._graphs.clear()
                self.note = (f"CUDA graph capture failed, running the {self.what} eagerly: {err or 'on another rank'}")[
                    :300
                ]
                return eager()
            entry = self._graphs[key] = (g, out, static)
            self.captures += 1
        else:
            for b, t in zip(entry[2], inputs):
                b.copy_(t, non_blocking=True)
        self._graphs.move_to_end(key)
        _backend().replay(entry[0])
        self.replays += 1
        return entry[1]
