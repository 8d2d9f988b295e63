"""A batch's tail (``paged_tail.PagedTail``) over p simulated ranks: placement, growth of its
views, extensions cut back, and exact decode."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, begin_step
from treeattn_cli.engine.paged_tail import PagedTail
from treeattn_cli.engine.pool import BlockPool
from treeattn_cli.parallel.merge import merge_partials
from treeattn_cli.parallel.ring import chunk_bounds
from treeattn_kernels import partial_attention, partial_attention_ref


def Tail(layers, slots, kv_heads, d, *, rank=0, world=1, static=False, capacity=0, tokens=512):
    """A tail of ``slots`` slots in a pool of its own, every slot admitted for ``tokens`` tokens."""
    pool = BlockPool(layers, kv_heads, d, page=8, num_blocks=slots * -(-tokens // 8))
    t = PagedTail(pool, slots, rank=rank, world=world, capacity=capacity, static=static)
    for b in range(slots):
        t.admit(b, tokens)
    return t


def test_placement_balances_within_one_token():
    """Each slot's tokens go where its document and tail together hold the fewest (``beside``:
    the document's shard on every rank), the same on every rank, within one token."""
    p = 3
    caches = [Tail(1, 2, 1, 8, rank=r, world=p) for r in range(p)]
    b = chunk_bounds(14, p)  # 5, 5, 4
    doc = [b[i + 1] - b[i] for i in range(p)]
    for c in caches:
        c.reset_rows([0, 1], [doc, doc])
    for step in range(100):
        owners = [c.place() for c in caches]
        assert all(torch.equal(owners[0], o) for o in owners), "ranks disagree on placement"
        counts = caches[0].counts + caches[0].beside
        assert (counts.max(1).values - counts.min(1).values).max() <= 1, (step, counts)
    assert (caches[0].counts + caches[0].beside).sum(1).tolist() == [114, 114]
    # ties go to the lowest rank: from [5, 5, 4] the next owners are 2, 0, 1, 2, 0, 1 ...
    c = Tail(1, 1, 1, 8, rank=0, world=3)
    c.reset_rows([0], [[5, 5, 4]])
    assert [c.place().item() for _ in range(6)] == [2, 0, 1, 2, 0, 1]


def test_views_grow_geometrically_and_keep_data():
    """One slot, 300 decode steps: its views widen by doubling (a static step's graph is captured
    again only O(log n) times), and every token is read back where it was written."""
    c = Tail(2, 1, 1, 4, rank=0, world=1, tokens=304)
    caps = set()
    for t in range(300):
        begin_step(c, torch.tensor([t]))
        kv = torch.full((1, 1, 1, 4), float(t))
        for layer in range(2):
            c.update(layer, kv, -kv)
        c.end_step()
        caps.add(c.capacity)
    assert caps == {64, 128, 256, 512}  # doublings only
    k, v, kv_len, pos = c.view_rows(1, [0])
    assert kv_len.tolist() == [300] and pos[0].tolist() == list(range(300))
    assert torch.equal(k[0, 0, :, 0], torch.arange(300.0)) and torch.equal(v, -k)


@pytest.mark.parametrize("static", [False, True])
def test_decode_over_simulated_ranks_is_exact(static):
    """p tails fed the same questions (an extension of every slot) and decode tokens (3 slots):
    the merge of their partials equals attention over the whole sequence, every step."""
    p, L, B, H_kv, G, d = 3, 2, 3, 2, 2, 16
    n_prompt = 10
    caches = [Tail(L, B, H_kv, d, rank=r, world=p, static=static, tokens=32) for r in range(p)]
    keys = {layer: torch.randn(B, H_kv, n_prompt, d) for layer in range(L)}
    vals = {layer: torch.randn(B, H_kv, n_prompt, d) for layer in range(L)}
    for c in caches:
        c.begin_extend(list(range(B)), torch.arange(n_prompt).expand(B, n_prompt))
        for layer in range(L):
            c.extend(layer, keys[layer], vals[layer])
        c.end_extend()
    for step in range(7):
        pos = torch.full((B,), n_prompt + step)
        stores = [begin_step(c, pos) for c in caches]
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
    allpos = sorted(x for c in caches for x in c.view_rows(0, [0])[3][0][: c.length[0]].tolist())
    assert allpos == list(range(n_prompt + 7))


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
    caches = [Tail(1, 2, 1, 4, rank=r, world=world) for r in range(world)]
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
    """Cutting an extension back is only possible while its tokens are the slot's newest: after a
    decode token or a reset it raises instead of dropping other tokens."""
    c = Tail(1, 2, 1, 4)
    _extend([c], [0, 1], [[1, 2], [3, 4]])
    begin_step(c, torch.tensor([3, 5]), active=[True, False])
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
