"""Prefix reuse by block (issue 35, item 4): a document's full blocks in the rank's pool carry a
key chained from the start of the tokens (and the digest of every token up to the end of the
prefill segment that computed them), so a later document starting with the same tokens, or the
same document after it left memory, takes those blocks instead of prefilling them, and holds
exactly the numbers a prefill alone would."""

from __future__ import annotations

import pytest
from treeattn_cli.engine.decode import segments
from treeattn_cli.engine.room import PAGE
from treeattn_cli.engine.prefill import shard, size
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.parallel.launch import run_local
from ranks import complete_document

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
    got = run_local(document_prefix_reuse, world, job, DOC, EXTRA, PIECE, timeout_s=60)[0]
    segs_a, segs_b = segments(len(DOC), world, PIECE), segments(len(DOC) + len(EXTRA), world, PIECE)
    assert got["a"] == {"source": "prefill", "reused": 0, "segments": len(segs_a)}, got
    # B shares A's segments but A's last one (cut at A's end): those tokens are found, the rest prefilled
    assert segs_b[: len(segs_a) - 1] == segs_a[:-1] and segs_b[len(segs_a) - 1] != segs_a[-1]
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
    for k in (
        "c_reads_its_table",
        "e_same",
        "b_uneven_same",
        "b_same",
        "b_again_same",
        "c_same",
        "a_again_same",
        "other_piece_same",
    ):
        assert got[k], (k, got)


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def document_prefix_reuse(ctx, job, doc_a, extra, piece):
    """Documents sharing a prefix in the block pool (``documents.Documents``): A prefilled;
    B = A + ``extra`` takes A's cached blocks for their common segments; both leave memory and
    come back from their cached blocks, without a prefill; C, A less its last 10 tokens, takes
    A's blocks up to inside a block and writes its own tail into a copy of that block (B holds it
    too); E, A less 15, does the same when no other table holds it: it writes into that block,
    which loses its key; A asked with another ``piece``
    takes nothing. Each time the document's keys, values, positions and counts must equal a
    plain cache prefilled alone with the same ``piece``. Rank 0 returns ``{check: bool or
    number}``, every rank's booleans and-ed."""
    import torch

    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    D = eng.documents

    def plain(ids, pc):
        other = eng.documents.new_shard()
        eng.dec.prefill(other, torch.tensor([ids]), pc)
        return other

    def same(doc, ids, pc=piece):
        ref = plain(ids, pc)
        return bool(
            doc.cache.max_len == ref.max_len
            and torch.equal(doc.cache.counts, ref.counts)
            and all(
                torch.equal(x, y)
                for layer in range(ref.num_layers)
                for x, y in zip(doc.cache.view(layer), ref.view(layer))
            )
        )

    def get(key, ids, pc=piece):
        d = D.get({"key": key, "ids": ids, "piece": pc, "host_memory": 0})  # (the pool alone: no host tier)
        info = {"source": d.source, "reused": d.reused, "segments": len(d.todo)}
        complete_document(D, d)
        return d, info

    out = {}
    a, out["a"] = get("a", doc_a)
    b_ids = doc_a + extra
    b, out["b"] = get("b", b_ids)
    out["b_same"] = same(b, b_ids)
    D._evict("a")
    D._evict("b")
    b2, out["b_again"] = get("b", b_ids)
    out["b_again_same"] = same(b2, b_ids)
    c_ids = doc_a[: len(doc_a) - 10]  # while B holds A's blocks: C's tail goes into a copy
    copies = D.pool.copies
    c, out["c"] = get("c", c_ids)
    out["c_same"] = same(c, c_ids)
    out["c_copied"] = D.pool.copies > copies
    out["c_reads_its_table"] = set((c.cache._slots // D.pool.page).tolist()) == set(c.cache.table.blocks)
    for key in ("b", "c"):
        D._evict(key)
    e_ids = doc_a[: len(doc_a) - 15]  # no table holds A's blocks now: E takes over the partial one
    copies = D.pool.copies
    e, out["e"] = get("e", e_ids)
    out["e_same"] = same(e, e_ids)
    out["e_took_over"] = D.pool.copies == copies
    D._evict("e")
    a2, out["a_again"] = get("a", doc_a)  # C wrote into a copy, E into a block whose key it dropped
    out["a_again_same"] = same(a2, doc_a)
    other, out["other_piece"] = get("a-other-piece", doc_a, piece + 8)
    out["other_piece_same"] = same(other, doc_a, piece + 8)
    for key in ("a", "a-other-piece"):
        D._evict(key)
    if ctx.rank == eng.world.world - 1:  # this rank's pool lost some of B's blocks: it finds fewer
        out["forgot"] = D.pool.forget(b2.keys[2:])
    b3, out["b_uneven"] = get("b", b_ids)
    out["b_uneven_same"] = same(b3, b_ids)
    flags = [v for v in out.values() if isinstance(v, bool)]
    every = eng.world.all_gather_values([int(all(flags))] + [int(v) for v in flags])
    ok = every.min(dim=0).values.tolist()
    names = [k for k, v in out.items() if isinstance(v, bool)]
    return {**out, **{k: bool(x) for k, x in zip(names, ok[1:])}} if ctx.rank == 0 else None
