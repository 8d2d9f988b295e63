"""One wait for the device a decode step (issue 38): rank 0 reads the tokens it sampled once (every
slot of a batch together), the other ranks read the step's message once, what goes to the device
goes in one copy a rank and step (the message on rank 0 too), and the model's forward reads
nothing back, on the GPU's choice of kernels (``TREEATTN_KERNEL=triton``, interpreted here). A
read that creeps into a step (a ``.tolist()`` of a device tensor, an ``int()`` of a length) fails
here: on a GPU each one stalls the host until the device has caught up."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from treeattn_cli.engine.job import EngineJob  # noqa: E402
from treeattn_cli.parallel.launch import run_local  # noqa: E402
import os

NEW = 4
DOC = [(13 * i + 5) % 230 + 20 for i in range(24)]
QS = [[(29 * i + 11 + j) % 230 + 20 for i in range(3)] for j in range(3)]
# two more over documents of the block pool (serve's): the engine's document and two of the pool
# read as groups of rows (the dense kernel per group), the pool's alone through the paged kernel
POOLED = [{"ids": QS[1], "doc": {"key": "a", "ids": DOC[::-1]}}, {"ids": QS[2], "doc": {"key": "b", "ids": DOC[3:]}}]
# The only other reads of tensors a step's requests may make: the host's own bookkeeping, kept in
# host tensors on purpose (every rank's token counts and lengths, where each token goes). A read
# anywhere else is a new wait for the device: make it go through engine.transfers or keep the value on
# the host, and add a site here only for a host tensor.
HOST_BOOKKEEPING = {
    "paged_tail.py:plan_step",
    "paged_tail.py:max_len",
    "paged_tail.py:begin_extend",
    "paged_tail.py:fewest_first",
    "paged_tail.py:reset_rows",
    "documents.py:tokens",
    "decode.py:_prefill",
    "decode.py:_prefill_replicated",
    "pool.py:chain_key",
    "record.py:run_record",
    "record.py:<listcomp>",
    "paged_tail.py:view_rows",
    "paged_tail.py:rows_tables",
    "paged_tail.py:most_here",  # (the tail in
    # the pool: the same host lengths, gathered or as tables, and a question's admission reading
    # its document's counts)
    # rounds that make a document resident, not steps: the ranks agree on room and
    # segments (one collective each, read), and report their pools as questions begin
    "comm.py:all_true",
    "comm.py:all_min",
    "block_reuse.py:plan",
    "documents.py:pools",
}


def test_a_step_reads_the_device_once_and_copies_to_it_once(tiny):
    """Between two of the steps' message broadcasts (one round of a batch, one token alone) a
    rank reads the device at most once (the tokens of its ready slots, or the message), makes
    one copy to the device a forward (its inputs) and rank 0 one more (the message); the forward
    of a plain step copies nothing more, and nothing else reads a tensor but the host's own
    bookkeeping."""
    model = tiny("llama", seed=3, head_dim=64, num_hidden_layers=1)
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW, reserve=64, auto_layout=True)
    ranks = run_local(host_reads_per_step, 2, job, DOC, QS + POOLED, NEW, timeout_s=600)
    for rank, got in enumerate(ranks):
        assert got["forward_copies"] == [], (rank, got["forward_copies"])  # a plain step's forward copies nothing
        assert set(got["step_reads"]) <= HOST_BOOKKEEPING, (rank, sorted(set(got["step_reads"]) - HOST_BOOKKEEPING))
        for route in ("batch", "alone"):  # chat --batch / serve's steps, and a single answer's
            steps = got[route]
            assert len(steps) > NEW and sum(s["forward"] for s in steps) >= NEW - 1, (rank, route, steps)
            for s in steps:
                assert s["read"] <= 1 and s["send"] <= s["forward"] + (rank == 0), (rank, route, steps)
            assert sum(s["read"] for s in steps) >= NEW - 1, (rank, route, steps)  # the feature was on


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


class _Reads:
    """Every read of a tensor's values on the host made from code outside torch and Triton (the
    interpreter reads its tensors as it runs kernels in Python): ``int()``, ``float()``,
    ``bool()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``torch.equal``, ``nonzero``, and every
    ``torch.tensor(data, device=...)`` (host data copied to the device); each recorded as
    ``file:function`` of the code that made it."""

    OPS = ("_local_scalar_dense", "item", "equal", "nonzero", "is_nonzero")  # (under inference_mode int() is aten.item)

    def __init__(self):
        self.sites: list[str] = []
        self.on = False

    def site(self):
        import sys

        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if "/torch/" not in name and "/triton/" not in name and not name.endswith(("/ranks.py", "/test_host.py")):
                return f"{name.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
            if "/triton/" in name:
                return None
            f = f.f_back
        return None

    def record(self):
        if self.on:
            s = self.site()
            if s is not None:
                self.sites.append(s)


def host_reads_per_step(ctx, job, doc, questions, new):
    """The engine's steps on these ranks with ``TREEATTN_KERNEL=triton`` (the GPU's choice of
    kernels), a batch of ``questions`` (token lists over ``doc``, or requests naming a document of
    the block pool: the paged kernel's path) and then one answer alone (the first question): every
    rank returns, per interval between two of the steps' message broadcasts, its device reads
    (``engine.transfers.read``), copies (``transfers.Staging``) and forwards; the copies of host data to the
    device the model's forward made on plain steps (``forward_copies``: none may), and every
    other read of a tensor the requests made, by site (``step_reads``, :class:`_Reads`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from treeattn_cli.engine import transfers
    from treeattn_cli.engine.decode import Decoder
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.sampling import Sampling
    from treeattn_cli.parallel.comm import Comm

    reads, events, step_reads = _Reads(), [], _Reads()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _Reads.OPS:
                step_reads.record()
            return func(*args, **(kwargs or {}))

    real = {
        "tolist": torch.Tensor.tolist,
        "numpy": torch.Tensor.numpy,
        "forward": Decoder._forward,
        "tensor": torch.tensor,
        "read": transfers.read,
        "send": transfers.Staging.send,
        "broadcast": Comm.broadcast,
    }

    def tolist(t):
        step_reads.record()
        return real["tolist"](t)

    def numpy(t, *a, **kw):
        step_reads.record()
        return real["numpy"](t, *a, **kw)

    def tensor(data, *a, **kw):  # host data made into a device tensor: a copy inside the forward
        if kw.get("device") is not None:
            reads.record()
        return real["tensor"](data, *a, **kw)

    def forward(self, ids, positions, want_logits, rows=1):
        events.append("forward")
        reads.on = self.actx.phase in ("cascade", "decode") and ids.shape[1] == 1  # a plain step
        try:
            return real["forward"](self, ids, positions, want_logits, rows)
        finally:
            reads.on = False

    def read(t):  # the sanctioned read: not one of the strays counted
        events.append("read")
        was, step_reads.on = step_reads.on, False
        try:
            return real["read"](t)
        finally:
            step_reads.on = was

    def send(self, *rows):
        events.append("send")
        return real["send"](self, *rows)

    def broadcast(self, t, src=0):
        events.append("msg")
        return real["broadcast"](self, t, src)

    common = {"max_new_tokens": new, "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": "off"}
    os.environ["TREEATTN_KERNEL"] = "triton"
    torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, Decoder._forward = tolist, numpy, tensor, forward
    transfers.read, transfers.Staging.send, Comm.broadcast = read, send, broadcast
    sent, ctx.emit = ctx.emit, (lambda kind, p: None)
    out = {}
    try:
        eng = Engine(ctx, job)
        eng.serve([{"op": "append", "ids": doc}, {"op": "mark", "name": "doc"}])
        for name, reqs in (
            ("batch", [{"op": "batch", "questions": questions, "slots": len(questions), **common}]),
            (
                "alone",
                [
                    {"op": "append", "ids": questions[0]},
                    {"op": "decode", "seq": 0, "keep": False, **common},
                    {"op": "rollback", "name": "doc"},
                ],
            ),
        ):
            events.clear()
            step_reads.on = True
            try:
                with Mode():
                    eng.serve(reqs)
            finally:
                step_reads.on = False
            intervals, cur = [], {"read": 0, "send": 0, "forward": 0}
            for e in events:
                if e == "msg":
                    intervals.append(cur)
                    cur = {"read": 0, "send": 0, "forward": 0}
                else:
                    cur[e] += 1
            out[name] = intervals + [cur]
        out["forward_copies"] = sorted(set(reads.sites))
        out["step_reads"] = sorted(set(step_reads.sites))
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, Decoder._forward = (
            real["tolist"],
            real["numpy"],
            real["tensor"],
            real["forward"],
        )
        transfers.read, transfers.Staging.send, Comm.broadcast = real["read"], real["send"], real["broadcast"]
        os.environ.pop("TREEATTN_KERNEL", None)
        ctx.emit = sent
    return out
