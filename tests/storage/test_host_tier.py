"""The host-memory tier behind the block pool (issue 52, item 1): a document the pool had to give
up keeps a copy of each rank's shard in host memory and comes back by a copy, not a prefill,
holding the same bytes it held before (so every answer over it is the one it gave before); the
tier keeps the least recently used copies within its budget; without a tier (``--host-memory
0``) or past its budget the document is prefilled again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treeattn_cli.storage.host_tier import HostTier, copy_in
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.engine.paged_shard import PagedShard
from treeattn_cli.engine.pool import BlockPool
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models

from ranks import greedy_batch, recording

NEW = 5
SMALL = [(13 * i + 5) % 230 + 20 for i in range(60)]  # 30 tokens a rank: 2 blocks of 16
BIG = [(7 * i + 3) % 200 + 30 for i in range(200)]  # 100 a rank: 7 blocks; with SMALL's 2 and a tail, past 8
Q = [(29 * i + 11) % 230 + 20 for i in range(5)]


def _shard(pool: BlockPool, n: int, seed: int) -> PagedShard:
    """A one-rank shard of ``n`` tokens of random rows in ``pool``."""
    g = torch.Generator().manual_seed(seed)
    sh = PagedShard(pool, rank=0, world=1)
    sh.begin_fill(torch.arange(n), [n])
    for layer in range(pool.num_layers):
        sh.fill_layer(
            layer,
            torch.randn(1, pool.kv_heads, n, pool.head_dim, generator=g),
            torch.randn(1, pool.kv_heads, n, pool.head_dim, generator=g),
        )
    return sh


def test_the_tier_keeps_the_least_recently_used_within_its_budget():
    """Copies past the budget push the oldest out; one larger than the whole budget is not kept;
    a copy taken for a restore that did not happen goes back as the newest; a copy holds the
    shard's rows, positions and counts, bit for bit, whatever becomes of the shard's blocks."""
    pool = BlockPool(2, 2, 8, page=4, num_blocks=16, dtype=torch.float32)
    tier = HostTier(300)
    a, b, c = (_shard(pool, 5, s) for s in (1, 2, 3))
    rows, pos = [t.clone() for layer in range(2) for t in b.layer_tensors(layer)], b.pos.clone()
    assert tier.put("a", a, [1] * 5, 100) and tier.put("b", b, [2] * 5, 100)
    b.free()
    _shard(pool, 12, 9)  # b's blocks taken and overwritten: the copy is the tier's own
    assert tier.put("c", c, [3] * 5, 150)  # 350 > 300: the oldest ("a") leaves
    assert list(tier.copies) == ["b", "c"]
    assert not tier.put("huge", c, [3] * 5, 301) and "huge" not in tier
    got = tier.take("b")
    assert list(tier.copies) == ["c"] and got.ids == [2] * 5 and got.counts.tolist() == [5]
    tier.add("b", got)
    assert list(tier.copies) == ["c", "b"]
    assert HostTier(0).put("a", c, [3] * 5, 1) is False  # no tier: nothing kept
    other = BlockPool(2, 2, 8, page=4, num_blocks=8, dtype=torch.float32)
    _shard(other, 6, 5)  # (its first blocks taken: the copy lands elsewhere)
    back = PagedShard(other, rank=0, world=1)
    copy_in(tier.take("b"), back)
    assert all(torch.equal(x, y) for x, y in zip(rows, [t for layer in range(2) for t in back.layer_tensors(layer)]))
    assert torch.equal(back.pos, pos) and back.counts[0].tolist() == [5]


def host_round_trip(ctx, job, small, big, q, new, host_memory):
    """``small`` answered (``q``), then ``big`` takes the pool (``small`` leaves it), then ``q``
    over ``small`` again. Every rank returns whether ``small``'s copy sat in its host tier after
    ``big``, and whether its shard after the return holds the bytes it held before; rank 0 also
    the answers, how each document became resident and the engine's reports."""
    from treeattn_cli.engine.engine import Engine

    base = greedy_batch(new, pool_blocks=8, page=16, host_memory=host_memory)
    out: dict = {"answers": [], "sources": []}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        before = None
        for name, ids in (("small", small), ("big", big), ("small", small)):
            rec.clear()
            eng.serve([{**base, "questions": [{"ids": q, "doc": {"key": name, "ids": ids}}]}])
            out["answers"].append(rec.answers.get(0))
            out["sources"].append(rec.sources.get(0))
            docs = eng.documents
            if name == "small" and before is None:
                sh = docs.resident["small"].cache
                before = [t.clone() for layer in range(sh.num_layers) for t in sh.layer_tensors(layer)]
            elif name == "big":
                out["hosted"] = "small" in docs.host and "small" not in docs.resident
        sh = eng.documents.resident["small"].cache
        after = [t for layer in range(sh.num_layers) for t in sh.layer_tensors(layer)]
        out["same_bytes"] = len(after) == len(before) and all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(before, after)
        )
        out["host_after"] = list(eng.documents.host.copies)
        out["reports"] = rec.reports
        eng.serve([{"op": "stop"}])
    return out


def small_pool(new: int, slots: int) -> dict:
    """A batch of ``slots`` answers of ``new`` tokens, a pool of 16 blocks of 16."""
    return greedy_batch(new, slots, pool_blocks=16, page=16)


def restore_in_parts(ctx, job, small, big, q, new):
    """``small`` then ``big`` answered in a pool with room for both; ``small`` sent to the host
    tier (``Documents.evict(0)``: all but the newest out) and its cached blocks forgotten; then one batch of two questions, one
    over ``big`` (resident) and one over ``small`` (in host memory), with a restore of one layer
    per round. Rank 0 returns the batch's answers, how each document was made resident, the
    restore's rounds and the document rounds run while an answer was under way."""
    from treeattn_cli.storage import host_tier
    from treeattn_cli.engine.engine import Engine

    host_tier.RESTORE_BYTES_PER_ROUND = 1  # one layer a round (the least a round copies)
    base = small_pool(new, slots=2)
    out = {}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        for name, ids in (("small", small), ("big", big)):
            eng.serve([{**base, "questions": [{"ids": q, "doc": {"key": name, "ids": ids}}]}])
        keys = eng.documents.resident["small"].keys
        eng.documents.evict(0)
        eng.documents.pool.forget(keys)  # (its cached blocks reused since, as a busy pool's would be)
        out["hosted"] = "small" in eng.documents.host and "big" in eng.documents.resident
        rec.clear()
        eng.serve(
            [
                {
                    **base,
                    "questions": [
                        {"ids": q, "doc": {"key": "big", "ids": big}},
                        {"ids": q, "doc": {"key": "small", "ids": small}},
                    ],
                }
            ]
        )
        out["answers"], out["sources"] = [rec.answers.get(i) for i in (0, 1)], [rec.sources.get(i) for i in (0, 1)]
        out["parts"], out["alongside"] = eng.documents.restore_parts, eng.bd.segments_while_decoding
        eng.serve([{"op": "stop"}])
    return out if ctx.rank == 0 else None


def evicted_mid_restore(ctx, job, small, big, q, new, root):
    """As :func:`restore_in_parts` up to ``small`` in the host tier; then ``small`` asked for and
    its restore begun (one layer of four copied), and evicted there, a cache directory known
    (``root``). Rank 0 returns what the restore had copied, whether the tier holds the same
    copy again (whole), what ``root`` holds, and then the answer over ``small`` asked again,
    with how it came."""
    from treeattn_cli.storage import host_tier
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.storage.kvstore import model_identity

    host_tier.RESTORE_BYTES_PER_ROUND = 1  # one layer a round
    base = small_pool(new, slots=1)
    out = {}
    with recording(ctx) as rec:
        eng = Engine(ctx, job)
        docs = eng.documents
        for name, ids in (("small", small), ("big", big)):
            eng.serve([{**base, "questions": [{"ids": q, "doc": {"key": name, "ids": ids}}]}])
        keys = docs.resident["small"].keys
        docs.evict(0)
        docs.pool.forget(keys)
        copy = docs.host.copies["small"]
        doc = docs.get({"key": "small", "ids": small, "piece": 8})
        out["copied"] = (doc.restore is copy, doc.restored, len(copy.layers))
        docs.spill_dir, docs.spill_meta = str(root), {"identity": model_identity(job.model_dir), "composition": {}}
        docs._evict("small")  # mid-restore: the copy goes back whole; its blocks are no copy of anything
        out["back"] = docs.host.copies.get("small") is copy and len(copy.layers) == 4
        out["saved"] = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
        docs.spill_dir = docs.spill_meta = None
        rec.clear()
        eng.serve([{**base, "questions": [{"ids": q, "doc": {"key": "small", "ids": small}}]}])
        out["answer"], out["source"] = rec.answers.get(0), rec.sources.get(0)
        eng.serve([{"op": "stop"}])
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def llama(tiny):
    path = tiny("llama", seed=3)
    return path, [tiny_models.hf_greedy(path, doc + Q, NEW) for doc in (SMALL, BIG)]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_document_the_pool_gave_up_comes_back_from_host_memory_bit_for_bit(llama, kv_dtype):
    """On two ranks, in fp32 and in an fp8 cache: the small document's return is a copy from the
    host tier (``host``, reported as made from it, the tier's copy taken), its shard holds the
    bytes it held before on every rank, and the answers are transformers' (fp32) or the first
    answer again (fp8: the answer over the same bytes)."""
    path, want = llama
    job = EngineJob(str(path), [], dtype="float32", kv_dtype=kv_dtype, max_new_tokens=NEW)
    outs = run_local(host_round_trip, 2, job, SMALL, BIG, Q, NEW, None, timeout_s=180)
    lead = outs[0]
    assert lead["sources"] == ["prefill", "prefill", "host"], lead["sources"]
    assert all(o["hosted"] and o["same_bytes"] and o["host_after"] == ["big"] for o in outs), outs
    if kv_dtype == "auto":
        assert lead["answers"] == [want[0], want[1], want[0]]
    assert lead["answers"][2] == lead["answers"][0]
    made = [m for r in lead["reports"] for m in r.get("made", [])]
    assert [m["source"] for m in made if m["key"] == "small"] == ["prefill", "host"], made
    assert any(r.get("host") == ["small"] for r in lead["reports"]), lead["reports"]


@pytest.mark.parametrize("host_memory", [0, 1000])
def test_without_a_tier_or_past_its_budget_the_document_is_prefilled_again(llama, host_memory):
    """``--host-memory 0``, and a tier smaller than the document's shard: nothing kept, the
    document prefilled again, the same answer."""
    path, want = llama
    job = EngineJob(str(path), [], dtype="float32", max_new_tokens=NEW)
    lead = run_local(host_round_trip, 2, job, SMALL, BIG, Q, NEW, host_memory, timeout_s=180)[0]
    assert lead["sources"] == ["prefill", "prefill", "prefill"] and not lead["hosted"], lead
    assert lead["answers"] == [want[0], want[1], want[0]]


def test_a_restore_comes_a_part_per_round_while_other_answers_step(tiny):
    """Issue 52, item 1: a document coming back from host memory is copied a few layers per round
    of the step loop (here one), and the answers under way keep stepping meanwhile: the question
    over the resident document answers while the other's document comes back (rounds of it run
    alongside), and both answers are transformers'."""
    path = tiny("llama", seed=5, num_hidden_layers=4)
    want = [tiny_models.hf_greedy(path, doc + Q, NEW) for doc in (BIG, SMALL)]
    job = EngineJob(str(path), [], dtype="float32", max_new_tokens=NEW)
    lead = run_local(restore_in_parts, 2, job, SMALL, BIG, Q, NEW, timeout_s=180)[0]
    assert lead["hosted"], lead
    assert lead["sources"] == ["memory", "host"] and lead["answers"] == want, lead
    assert lead["parts"] == 4 and lead["alongside"] >= 2, lead  # 4 layers, one a round; some while `big` answered


def test_a_document_evicted_mid_restore_gives_its_copy_back_whole_and_saves_nothing(tiny, tmp_path):
    """Issue 52: a document leaving the pool while its restore is under way (one layer of four
    copied in) puts the host tier's copy back as it was, whole, and writes nothing to the cache
    directory (its blocks hold part of a copy, not the document); asked again, it comes back
    from that copy and answers transformers' tokens."""
    path = tiny("llama", seed=5, num_hidden_layers=4)
    want = tiny_models.hf_greedy(path, SMALL + Q, NEW)
    job = EngineJob(str(path), [], dtype="float32", max_new_tokens=NEW)
    lead = run_local(evicted_mid_restore, 2, job, SMALL, BIG, Q, NEW, tmp_path / "cache", timeout_s=180)[0]
    assert lead["copied"] == (True, 1, 4) and lead["back"], lead
    assert lead["saved"] == [], lead["saved"]
    assert lead["source"] == "host" and lead["answer"] == want, lead
