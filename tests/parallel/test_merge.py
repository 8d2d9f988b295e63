"""merge.py: exactness of the N-way and pairwise LSE merges, empty shards included."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import assert_close
from treeattn_cli.parallel.merge import merge_pair, merge_partials, unweigh, weigh
from treeattn_kernels import partial_attention_ref


def random_split(N, S):
    """Uneven cut points of N keys into S shards, some possibly empty."""
    cuts = sorted(random.randint(0, N) for _ in range(S - 1))
    return [0, *cuts, N]


def shard_partials(q, k, v, bounds):
    parts = [partial_attention_ref(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


@pytest.mark.parametrize("S", range(1, 9))
def test_nway_merge_equals_unsplit(S):
    B, H, H_kv, Q, N, d = 3, 8, 2, 2, 97, 64
    q, k, v = torch.randn(B, H, Q, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    bounds = random_split(N, S)
    if S > 2:
        bounds[1] = bounds[0]  # force an empty shard
    o_s, lse_s = shard_partials(q, k, v, bounds)  # (S, B, H, Q, d), (S, B, H, Q)
    o, lse = merge_partials(o_s, lse_s)
    o_ref, lse_ref = partial_attention_ref(q, k, v)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


def test_tree_order_equals_sequential_equals_nway():
    B, H, Q, d, S = 2, 4, 1, 32, 7
    o_s = torch.randn(S, B, H, Q, d)
    lse_s = torch.randn(S, B, H, Q) * 5
    lse_s[2] = -math.inf  # an empty shard
    nway = merge_partials(o_s, lse_s)
    seq = functools.reduce(lambda a, b: merge_pair(*a, *b), zip(o_s, lse_s))

    def tree(items):
        while len(items) > 1:
            items = [
                merge_pair(*items[i], *items[i + 1]) if i + 1 < len(items) else items[i]
                for i in range(0, len(items), 2)
            ]
        return items[0]

    tr = tree(list(zip(o_s, lse_s)))
    for got in (seq, tr):
        assert_close(got[0], nway[0], torch.float32, "o")
        assert_close(got[1], nway[1], torch.float32, "lse")


def test_all_empty_gives_defined_result():
    o_s = torch.randn(4, 2, 3, 1, 8)
    lse_s = torch.full((4, 2, 3, 1), -math.inf)
    o, lse = merge_partials(o_s, lse_s)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = merge_pair(o_s[0], lse_s[0], o_s[1], lse_s[1])
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_one_side_empty_is_identity():
    o_a, lse_a = torch.randn(5, 8), torch.randn(5)
    o, lse = merge_pair(o_a, lse_a, torch.full((5, 8), 7.0), torch.full((5,), -math.inf))
    assert torch.allclose(o, o_a, rtol=0, atol=0) and torch.equal(lse, lse_a)
    o, lse = merge_pair(torch.full((5, 8), 7.0), torch.full((5,), -math.inf), o_a, lse_a)
    assert torch.allclose(o, o_a, rtol=0, atol=0) and torch.equal(lse, lse_a)


def test_weigh_unweigh_is_the_nway_merge():
    """The all-reduce form: SUM of [o·w, w] after a MAX of lse equals merge_partials."""
    o_s, lse_s = torch.randn(5, 2, 4, 3, 16), torch.randn(5, 2, 4, 3) * 30
    lse_s[1, 0] = -math.inf
    m = lse_s.amax(0)
    packed = sum(weigh(o_s[i], lse_s[i], m) for i in range(5))  # what all_reduce SUM returns
    o, lse = unweigh(packed, m)
    o_ref, lse_ref = merge_partials(o_s, lse_s)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


def test_large_magnitude_bf16_stays_finite():
    o_s = (torch.randn(4, 2, 8, 1, 64) * 1e3).bfloat16()
    lse_s = torch.randn(4, 2, 8, 1) * 1e4  # huge spread of logits
    o, lse = merge_partials(o_s, lse_s)
    o32, lse32 = merge_partials(o_s.float(), lse_s)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert_close(o, o32, torch.bfloat16, "o")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.just(-math.inf), st.floats(-50, 50)), min_size=3, max_size=3), st.integers(0, 2**31 - 1))
def test_merge_pair_associative(lses, seed):
    g = torch.Generator().manual_seed(seed)
    o = [torch.randn(2, 8, generator=g) for _ in range(3)]
    lse = [torch.full((2,), x) for x in lses]
    left = merge_pair(*merge_pair(o[0], lse[0], o[1], lse[1]), o[2], lse[2])
    right = merge_pair(o[0], lse[0], *merge_pair(o[1], lse[1], o[2], lse[2]))
    assert_close(left[0], right[0], torch.float32, "o")
    assert_close(left[1], right[1], torch.float32, "lse")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=8),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["float32", "bfloat16"]),
)
def test_any_shard_split_merges_to_the_unsplit_attention(sizes, seed, dtype):
    """Property: however the keys are cut (empty pieces included), the merge is the whole."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    N = sum(sizes)
    B, H, H_kv, d = 2, 4, 2, 16
    q = (torch.randn(B, H, 1, d, generator=g) * 4).to(dt)  # large logits
    k = (torch.randn(B, H_kv, N, d, generator=g) * 4).to(dt)
    v = torch.randn(B, H_kv, N, d, generator=g).to(dt)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    o_s, lse_s = shard_partials(q, k, v, bounds)
    o, lse = merge_partials(o_s, lse_s)
    o_ref, lse_ref = partial_attention_ref(q, k, v)
    assert torch.isfinite(lse).all() == (N > 0)
    assert_close(o.to(dt), o_ref, dt, "o")
    assert_close(lse, lse_ref, torch.float32 if dt == torch.float32 else dt, "lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weigh_unweigh_match_merge_py(dtype):
    """The Triton pack/finish kernels (interpreted here) equal merge.weigh / merge.unweigh, and
    the finish writes straight into a [B, Q, H, d] buffer (the layer's output layout)."""
    pytest.importorskip("triton")
    from treeattn_kernels.merge_triton import unweigh_fused, weigh_fused

    S, B, H, Q, d = 3, 2, 4, 3, 64
    o_s = torch.randn(S, B, H, Q, d).to(dtype)
    lse_s = torch.randn(S, B, H, Q) * 20
    lse_s[0, 1, 2] = -math.inf
    lse_s[:, 0, 0, 0] = -math.inf  # a row empty everywhere
    m = lse_s.amax(0)
    packed = sum(weigh_fused(o_s[i], lse_s[i], m) for i in range(S))
    ref = sum(weigh(o_s[i], lse_s[i], m) for i in range(S))
    assert_close(packed, ref, torch.float32, "packed")
    layer_out = torch.full((B, Q, H, d), math.nan, dtype=dtype)  # [B, Q, H, d]
    o, lse = unweigh_fused(packed, m, out=layer_out.transpose(1, 2), dtype=dtype)
    o_ref, lse_ref = unweigh(ref, m)
    assert not torch.isnan(layer_out).any()
    assert_close(layer_out.transpose(1, 2), o_ref.to(dtype), dtype, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert torch.equal(layer_out[0, 0, 0], torch.zeros(d, dtype=dtype)) and torch.isneginf(lse[0, 0, 0])


def test_fused_pair_merge_matches_merge_pair():
    """A step's two partials (the documents' rows, the tail's) merged in one launch (interpreted
    here) equal merge.merge_pair: strided inputs, a side empty for some rows (lse = -inf), a row
    empty on both (o = 0, lse = -inf, no NaN), the larger weight on either side."""
    pytest.importorskip("triton")
    from treeattn_kernels.merge_triton import merge_pair_fused

    B, H, Q, d = 3, 4, 2, 40  # d not a power of two: the tile is padded
    o_a = torch.randn(B, Q, H, d).transpose(1, 2)  # strided, as a layer's view
    o_b = torch.randn(B, H, Q, d)
    l_a, l_b = (torch.randn(B, Q, H) * 20).transpose(1, 2), torch.randn(B, H, Q) * 20  # (one strided)
    l_a[0, 1] = -math.inf
    l_b[1, 2] = -math.inf
    l_a[2, 0, 0] = l_b[2, 0, 0] = -math.inf
    o, lse = merge_pair_fused(o_a, l_a, o_b, l_b)
    o_ref, lse_ref = merge_pair(o_a, l_a, o_b, l_b)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape and not torch.isnan(o).any()
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert torch.equal(o[2, 0, 0], torch.zeros(d)) and torch.isneginf(lse[2, 0, 0])
    assert torch.equal(o[0, 1], o_b[0, 1]) and torch.equal(lse[0, 1], l_b[0, 1])  # one side empty: the other
    layer_out = torch.full((B, Q, H, d), math.nan, dtype=torch.bfloat16)  # [B, Q, H, d], the layer's layout
    got, lse2 = merge_pair_fused(o_a, l_a, o_b, l_b, out=layer_out.transpose(1, 2))
    assert got.data_ptr() == layer_out.data_ptr() and torch.equal(lse2, lse)
    assert torch.equal(layer_out.transpose(1, 2), o.to(torch.bfloat16))  # the same numbers, rounded once


@pytest.mark.parametrize("splits", [None, 3])
def test_two_calls_splits_reduce_and_merge_in_one_launch(monkeypatch, splits):
    """Issue 51: a step's documents' call (the batch's rows as one document's query rows, in two
    slices of the tile here) and its tail's call (each row its own table, one row with no keys)
    hand back their splits unreduced, and ``merge_two`` reduces each call's splits and merges the
    pair in one launch (interpreted here) with the bits of the three launches it replaces (each
    call's reduce, then ``merge_pair_fused``): in fp32, and into a bf16 layer layout; one side
    reduced already, the other not, the same."""
    pytest.importorskip("triton")
    from treeattn_kernels import Partials, merge_two, partial_triton, targets
    from treeattn_kernels.merge_triton import merge_pair_fused

    monkeypatch.setitem(partial_triton.ONE_SPLIT_COPY, "on", False)  # (the reduce a GPU launches)
    g = torch.Generator().manual_seed(5)
    H, H_kv, d, page, R = 8, 2, 32, 16, 6  # 4 query heads a KV head: 4 rows a tile, 6 rows in 2 slices
    kp, vp = torch.randn(40, H_kv, page, d, generator=g), torch.randn(40, H_kv, page, d, generator=g)
    q = torch.randn(R, H, 1, d, generator=g)
    doc = (q.transpose(0, 1).reshape(1, H, R, d), torch.arange(10)[None], torch.tensor([150]))
    tail = (
        q,
        torch.stack([torch.arange(10 + 3 * r, 13 + 3 * r) for r in range(R)]),
        torch.tensor([5, 17, 0, 33, 48, 1]),
    )
    paged = partial_triton.partial_attention_triton_paged
    (od, ld), (ot, lt) = (
        paged(x, kp, vp, t, n, num_splits=splits, out=torch.empty(x.shape)) for x, t, n in (doc, tail)
    )
    od, ld = od[0].view(H, R, 1, d).transpose(0, 1), ld[0].view(H, R, 1).transpose(0, 1)
    want = merge_pair_fused(od, ld, ot, lt)
    pd, pt = (paged(x, kp, vp, t, n, num_splits=splits, partials=True) for x, t, n in (doc, tail))
    assert isinstance(pd, Partials) and isinstance(pt, Partials) and pd.shape[:3] == (1, H, R) and pd.step == 4
    launched = targets._state["counted"] = []
    try:
        got = merge_two(pd.of_rows(1), pt)
    finally:
        targets._state["counted"] = None
    assert launched == ["_reduce_pair_kernel"], launched
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][2], od[2]) and torch.equal(got[1][2], ld[2])  # row 2's tail is empty: the document's
    assert torch.equal(merge_two((od, ld), pt)[0], want[0])  # one side reduced already
    layer = torch.full((R, 1, H, d), math.nan, dtype=torch.bfloat16)  # the layer's [R, T, H, d]
    merge_two(pd.of_rows(1), pt, out=layer.transpose(1, 2))
    assert torch.equal(layer.transpose(1, 2), want[0].to(torch.bfloat16))
    # an fp8 pool's output turned back from its rotated basis in the same launch (summed in the
    # kernel's order: within fp32 rounding of the merged o times the rotation), and into the layer
    rot = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    turned, lse = merge_two(pd.of_rows(1), pt, rotation=rot)
    torch.testing.assert_close(turned, want[0] @ rot, rtol=1e-6, atol=1e-6)
    assert torch.equal(lse, want[1])
    merge_two(pd.of_rows(1), pt, out=layer.transpose(1, 2), rotation=rot)
    torch.testing.assert_close(layer.transpose(1, 2).float(), turned, rtol=2**-8, atol=2**-8)
    torch.testing.assert_close(merge_two((od, ld), pt, rotation=rot)[0], turned, rtol=1e-6, atol=1e-6)
    # a call whose splits would take more than the cap is reduced as before (a big batch over a
    # long document keeps one slice's splits alive at a time), and merges the same
    monkeypatch.setattr(partial_triton, "PARTIALS_CAP", 1024)
    x, t, n = doc
    big = paged(x, kp, vp, t, n, num_splits=splits, partials=True, out=torch.empty(x.shape))
    assert not isinstance(big, Partials)
    big = (big[0][0].view(H, R, 1, d).transpose(0, 1), big[1][0].view(H, R, 1).transpose(0, 1))
    assert torch.equal(merge_two(big, pt)[0], want[0])


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16), (8, torch.float32)])
def test_fused_gathered_merge_matches_merge_partials(world, dtype):
    """The one-launch merge of an all-gather's ``[world, B, H, Q, d + 1]`` (interpreted here)
    equals merge.merge_partials, writing straight into the layer's [B, Q, H, d] layout, with
    ranks whose partial is empty and a row empty on every rank (o = 0, lse = -inf, no NaN)."""
    pytest.importorskip("triton")
    from treeattn_kernels.merge_triton import merge_gathered_fused

    B, H, Q, d = 2, 3, 2, 40  # d not a power of two: the tile is padded
    o_s = torch.randn(world, B, H, Q, d).to(dtype)
    lse_s = torch.randn(world, B, H, Q) * 20
    lse_s[0, 1, 2] = -math.inf
    lse_s[:, 0, 0, 0] = -math.inf
    every = torch.cat([o_s.float(), lse_s[..., None]], dim=-1)
    layer_out = torch.full((B, Q, H, d), math.nan, dtype=dtype)
    o, lse = merge_gathered_fused(every, out=layer_out.transpose(1, 2), dtype=dtype)
    o_ref, lse_ref = merge_partials(o_s, lse_s)
    assert not torch.isnan(layer_out).any()
    assert_close(layer_out.transpose(1, 2), o_ref.to(dtype), dtype, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert torch.equal(layer_out[0, 0, 0], torch.zeros(d, dtype=dtype)) and torch.isneginf(lse[0, 0, 0])
