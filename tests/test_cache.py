"""ShardedKVCache: placement, geometric growth, and exact decode over p simulated ranks."""

from __future__ import annotations

import torch

from helpers import assert_close
from treeattn_cli.engine.cache import ShardedKVCache
from treeattn_cli.parallel.merge import merge_partials
from treeattn_cli.parallel.ring import chunk_bounds
from treeattn_kernels import partial_attention, partial_attention_ref


def test_placement_balances_within_one_token():
    p = 3
    caches = [ShardedKVCache(1, 2, 1, 8, rank=r, world=p) for r in range(p)]
    b = chunk_bounds(14, p)  # 5, 5, 4
    for c in caches:
        c.set_counts([b[i + 1] - b[i] for i in range(p)])
    for step in range(100):
        owners = [c.place() for c in caches]
        assert all(torch.equal(owners[0], o) for o in owners), "ranks disagree on placement"
        counts = caches[0].counts
        assert (counts.max(1).values - counts.min(1).values).max() <= 1, (step, counts)
    assert caches[0].counts.sum(1).tolist() == [114, 114]
    # ties go to the lowest rank: from [5, 5, 4] the next owners are 2, 0, 1, 2, 0, 1 ...
    c = ShardedKVCache(1, 1, 1, 8, rank=0, world=3)
    c.set_counts([5, 5, 4])
    assert [c.place().item() for _ in range(6)] == [2, 0, 1, 2, 0, 1]


def test_capacity_grows_geometrically_and_keeps_data():
    c = ShardedKVCache(2, 1, 1, 4, rank=0, world=1)
    caps = set()
    ref = []
    for t in range(300):
        c.begin_step(torch.tensor([t]))
        kv = torch.full((1, 1, 1, 4), float(t))
        for layer in range(2):
            c.update(layer, kv, -kv)
        c.end_step()
        ref.append(t)
        caps.add(c.capacity)
    assert caps == {64, 128, 256, 512}  # doublings only: O(log n) copies, not one per token
    k, v, kv_len, pos = c.view(1)
    assert kv_len.tolist() == [300] and pos[0].tolist() == ref
    assert torch.equal(k[0, 0, :, 0], torch.arange(300.0)) and torch.equal(v, -k)


def test_a_large_cache_grows_by_a_quarter_not_double(monkeypatch):
    """Review R13: past ``GROW_GENTLY_BYTES`` a cache grows by a quarter (a long document's static
    cache no longer doubles at the first question), still geometrically, and keeps its data."""
    import treeattn_cli.engine.cache as cache_mod

    c = ShardedKVCache(2, 1, 1, 4, rank=0, world=1, capacity=1000)
    monkeypatch.setattr(cache_mod, "GROW_GENTLY_BYTES", c.nbytes())  # this cache counts as large
    c.k[0][0, 0, :1000, 0] = torch.arange(1000.0)
    c.reserve(1001)
    assert c.capacity == 1250
    c.reserve(1300)
    assert c.capacity == 1562  # 1250 + a quarter
    assert torch.equal(c.k[0][0, 0, :1000, 0], torch.arange(1000.0))


import pytest


@pytest.mark.parametrize("static", [False, True])
def test_decode_over_simulated_ranks_is_exact(static):
    """p caches fed the same prompt chunks and decode tokens (batch 3): the
    merge of their partials equals attention over the whole sequence, every step."""
    p, L, B, H_kv, G, d = 3, 2, 3, 2, 2, 16
    n_prompt = 10
    caches = [ShardedKVCache(L, B, H_kv, d, rank=r, world=p, static=static, capacity=16) for r in range(p)]
    keys = {layer: torch.randn(B, H_kv, n_prompt, d) for layer in range(L)}
    vals = {layer: torch.randn(B, H_kv, n_prompt, d) for layer in range(L)}
    b = chunk_bounds(n_prompt, p)
    for r, c in enumerate(caches):
        for layer in range(L):
            c.append_chunk(layer, keys[layer][:, :, b[r]:b[r + 1]], vals[layer][:, :, b[r]:b[r + 1]],
                            torch.arange(b[r], b[r + 1]))
        c.set_counts([b[i + 1] - b[i] for i in range(p)])
    for step in range(7):
        pos = torch.full((B,), n_prompt + step)
        stores = [c.begin_step(pos) for c in caches]
        assert (sum(s.long() for s in stores) == 1).all(), "each token stored exactly once"
        for layer in range(L):
            k_new, v_new = torch.randn(B, H_kv, 1, d), torch.randn(B, H_kv, 1, d)
            keys[layer] = torch.cat([keys[layer], k_new], 2)
            vals[layer] = torch.cat([vals[layer], v_new], 2)
            q = torch.randn(B, G * H_kv, 1, d)
            parts = []
            for c in caches:
                k_shard, v_shard, kv_len = c.update(layer, k_new, v_new)
                if static:
                    assert k_shard.shape[2] == c.capacity  # fixed shapes, valid length in kv_len
                parts.append(partial_attention(q, k_shard, v_shard, kv_len=kv_len))
            o, lse = merge_partials(torch.stack([x[0] for x in parts]), torch.stack([x[1] for x in parts]))
            o_ref, lse_ref = partial_attention_ref(q, keys[layer], vals[layer])
            assert_close(o, o_ref, torch.float32, f"step {step} layer {layer}")
            assert_close(lse, lse_ref, torch.float32, "lse")
        for c in caches:
            c.end_step()
    sizes = [c.length.tolist() for c in caches]
    assert [sum(s[i] for s in sizes) for i in range(B)] == [n_prompt + 7] * B
    # positions recorded: the union over ranks is every position exactly once
    allpos = sorted(x for c in caches for x in c.view(0)[3][0][: c.length[0]].tolist())
    assert allpos == list(range(n_prompt + 7))


def test_static_capacity_grows_on_the_same_step_on_every_rank(tmp_path):
    """Uneven shards (a 100-token prompt on 3 ranks, in prefill segments) from a capacity of 1:
    every rank's capacity changes on the same decode steps (the static step's CUDA graph is
    recaptured then, with collectives in its warm-up: ranks recapturing on different steps
    would hang). Growth is by the largest shard of any rank, known to all without a message."""
    from treeattn_cli.verify import tiny as tiny_models
    from treeattn_cli.parallel.launch import run_local

    import dist_cases

    d = tiny_models.make_model("llama", tmp_path / "m")
    res = run_local(dist_cases.capacity_trace, 3, str(d), 100, 120, timeout_s=120)
    traces = [t for t, _ in res]
    assert traces[0] == traces[1] == traces[2], traces
    assert len(set(traces[0])) >= 2  # it did grow while decoding
    assert res[0][1] == tiny_models.hf_greedy(d, (torch.arange(100) % 200 + 20).tolist(), 120)


def _extend(caches, rows, positions, d=4):
    """Extend ``rows`` of every simulated rank's cache by ``positions`` (K/V = the position)."""
    for c in caches:
        c.begin_extend(rows, positions)
        kv = torch.tensor(positions, dtype=torch.float32)[:, None, :, None].expand(-1, c.kv_heads, -1, d)
        c.extend(0, kv, -kv)
        c.end_extend()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_extending_one_row_never_touches_another_rows_extension(world):
    """Issue 32: a slot's rejected drafts are cut back after another slot took a new question.
    Row 0 gets three tokens (a verify), then row 1 is extended (a question entering its slot),
    then row 0 keeps one: row 0 holds exactly one token on the ranks together, row 1 keeps its
    two, and every rank agrees on the counts."""
    caches = [ShardedKVCache(1, 2, 1, 4, rank=r, world=world) for r in range(world)]
    _extend(caches, [0], [[10, 11, 12]])
    _extend(caches, [1], [[5, 6]])
    for c in caches:
        c.truncate_extension(0, keep=1)
    assert sum(int(c.host_length[0]) for c in caches) == 1
    assert sum(int(c.host_length[1]) for c in caches) == 2
    assert all(torch.equal(c.counts, caches[0].counts) for c in caches)
    assert caches[0].counts.sum(1).tolist() == [1, 2]
    kept = sorted(int(p) for c in caches for p in c.view_rows(0, [0])[3][0][: int(c.host_length[0])])
    assert kept == [10]  # the first token of the extension, not a rejected draft
    # row 1's own extension can still be cut back afterwards
    for c in caches:
        c.truncate_extension(1, keep=0)
    assert caches[0].counts.sum(1).tolist() == [1, 0]


def test_a_cut_back_after_newer_tokens_is_refused_not_silently_wrong():
    """Cutting an extension back is only possible while its tokens are the sequence's newest:
    after a decode token, a reset or a rollback it raises instead of dropping other tokens."""
    c = ShardedKVCache(1, 2, 1, 4)
    _extend([c], [0, 1], [[1, 2], [3, 4]])
    c.begin_step(torch.tensor([3, 5]), active=[True, False])
    c.update(0, torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    c.end_step()
    with pytest.raises(RuntimeError, match="no ended extension"):
        c.truncate_extension(0, keep=1)
    c.truncate_extension(1, keep=1)  # row 1 got no token this step: its extension is still newest
    assert c.host_length.tolist() == [3, 1]
    c.reset_rows([1])
    with pytest.raises(RuntimeError, match="no ended extension"):
        c.truncate_extension(1, keep=0)
    with pytest.raises(ValueError, match="twice"):
        c.begin_extend([0, 0], [[7], [8]])
    c.begin_extend([0], [[7]])
    with pytest.raises(RuntimeError, match="not ended"):
        c.begin_extend([1], [[8]])
