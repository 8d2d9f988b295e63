"""One wait for the device a decode step (issue 38): rank 0 reads the tokens it sampled once (every
slot of a batch together), the other ranks read the step's message once, what goes to the device
goes in one copy a rank and step (the message on rank 0 too), and the model's forward reads
nothing back, on the GPU's choice of kernels (``TREEATTN_KERNEL=triton``, interpreted here). A
read that creeps into a step (a ``.tolist()`` of a device tensor, an ``int()`` of a length) fails
here: on a GPU each one stalls the host until the device has caught up."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import dist_cases  # noqa: E402
from treeattn_cli.engine.job import EngineJob  # noqa: E402
from treeattn_cli.parallel.launch import run_local  # noqa: E402

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
HOST_BOOKKEEPING = {"paged_tail.py:plan_step", "paged_tail.py:max_len", "paged_tail.py:begin_extend",
                    "paged_tail.py:fewest_first", "paged_tail.py:reset_rows", "documents.py:tokens",
                    "decode.py:_prefill", "decode.py:_prefill_replicated",
                    "pool.py:chain_key", "record.py:run_record", "record.py:<listcomp>",
                    "paged_tail.py:view_rows", "paged_tail.py:rows_tables", "paged_tail.py:most_here",  # (the tail in
                    # the pool: the same host lengths, gathered or as tables, and a question's admission reading
                    # its document's counts)
                    # rounds that make a document resident, not steps: the ranks agree on room and
                    # segments (one collective each, read), and report their pools as questions begin
                    "comm.py:all_true", "comm.py:all_min", "block_reuse.py:plan", "documents.py:pools"}


def test_a_step_reads_the_device_once_and_copies_to_it_once(tiny):
    """Between two of the steps' message broadcasts (one round of a batch, one token alone) a
    rank reads the device at most once (the tokens of its ready slots, or the message), makes
    one copy to the device a forward (its inputs) and rank 0 one more (the message); the forward
    of a plain step copies nothing more, and nothing else reads a tensor but the host's own
    bookkeeping."""
    model = tiny("llama", seed=3, head_dim=64, num_hidden_layers=1)
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW, reserve=64, auto_layout=True)
    ranks = run_local(dist_cases.host_reads_per_step, 2, job, DOC, QS + POOLED, NEW, timeout_s=600)
    for rank, got in enumerate(ranks):
        assert got["forward_copies"] == [], (rank, got["forward_copies"])  # a plain step's forward copies nothing
        assert set(got["step_reads"]) <= HOST_BOOKKEEPING, (rank, sorted(set(got["step_reads"]) - HOST_BOOKKEEPING))
        for route in ("batch", "alone"):  # chat --batch / serve's steps, and a single answer's
            steps = got[route]
            assert len(steps) > NEW and sum(s["forward"] for s in steps) >= NEW - 1, (rank, route, steps)
            for s in steps:
                assert s["read"] <= 1 and s["send"] <= s["forward"] + (rank == 0), (rank, route, steps)
            assert sum(s["read"] for s in steps) >= NEW - 1, (rank, route, steps)  # the feature was on
