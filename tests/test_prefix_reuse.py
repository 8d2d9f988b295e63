"""Prefix reuse by block (issue 35, item 4): a document's full blocks in the rank's pool carry a
key chained from the start of the tokens (and the digest of every token up to the end of the
prefill segment that computed them), so a later document starting with the same tokens, or the
same document after it left memory, takes those blocks instead of prefilling them, and holds
exactly the numbers a prefill alone would."""

from __future__ import annotations

import pytest

import dist_cases
from treeattn_cli.engine.decode import segments
from treeattn_cli.engine.room import PAGE
from treeattn_cli.engine.prefill import shard, size
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.parallel.launch import run_local

PIECE = 40  # tokens per rank per segment: ends fall inside 64-token blocks
DOC = [(17 * i + 3) % 230 + 20 for i in range(420)]
EXTRA = [(11 * i + 7) % 230 + 20 for i in range(37)]


def found_segments(common, world):
    """How many of the ``common`` segments every rank finds in full 64-token blocks (a block
    past them was computed by another segment: another key)."""
    counts = [0] * world
    ends = [[0] * world]
    for s0, s1 in common:
        counts = [c + size(pc) for c, pc in zip(counts, shard(s0, s1 - s0, world))]
        ends.append(counts)
    return min(max(j for j, e in enumerate(ends) if e[r] <= ends[-1][r] // PAGE * PAGE) for r in range(world))


@pytest.mark.parametrize("world", [1, 2])
def test_documents_take_the_cached_blocks_of_their_prefix_and_hold_the_same_numbers(tiny, world):
    job = EngineJob(str(tiny("gemma2", seed=4)), [], dtype="float32", max_new_tokens=2)
    got = run_local(dist_cases.document_prefix_reuse, world, job, DOC, EXTRA, PIECE, timeout_s=60)[0]
    segs_a, segs_b = segments(len(DOC), world, PIECE), segments(len(DOC) + len(EXTRA), world, PIECE)
    assert got["a"] == {"source": "prefill", "reused": 0, "segments": len(segs_a)}, got
    # B shares A's segments but A's last one (cut at A's end): those tokens are found, the rest prefilled
    assert segs_b[:len(segs_a) - 1] == segs_a[:-1] and segs_b[len(segs_a) - 1] != segs_a[-1]
    j = found_segments(segs_a[:-1], world)
    assert 0 < j and got["b"] == {"source": "prefill", "reused": segs_a[j - 1][1], "segments": len(segs_b) - j}, got
    assert got["b_again"] == {"source": "pool", "reused": len(DOC) + len(EXTRA), "segments": 0}, got
    assert got["c"]["source"] == "prefill" and 0 < got["c"]["reused"] < len(DOC), got
    assert got["e"]["source"] == "prefill" and 0 < got["e"]["reused"] < len(DOC), got
    assert got["e_took_over"], got
    # E wrote into the block of A's it took over (the same numbers: the same segment computed
    # them), and published it again: A finds every block, and they hold what A's prefill would
    assert got["a_again"]["source"] == "pool", got
    assert got["other_piece"]["reused"] == 0, got  # other segments, other numbers: nothing shared
    assert got["c_copied"], got  # C's tail went into a private copy of the shared block
    # the last rank found B's first two blocks only: every rank takes what all of them found
    assert 0 < got["b_uneven"]["reused"] < len(DOC) + len(EXTRA) and got["b_uneven"]["segments"] > 0, got
    for k in ("c_reads_its_table", "e_same", "b_uneven_same", "b_same", "b_again_same", "c_same", "a_again_same", "other_piece_same"):
        assert got[k], (k, got)
