"""block_lse (issue 37): each row's log-sum-exp per block of keys, written beside the partial
attention: the torch reference and the Triton split kernel (dense, fp8, paged) against a
float64 brute force, and the identity citations rest on: exp(block_lse - lse) is a block's
share of the row's attention, summing to 1 over the blocks of every shard."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close
from treeattn_kernels import gather_pages, partial_attention, partial_attention_ref
from treeattn_kernels.partial_ref import LSE_BLOCKS, dequantize, key_mask


def brute(q, k, lse_block, *, mask=None, scale=None, softcap=None):
    """Float64 oracle: ``[B, H, Q, ceil(N / lse_block)]``, each row's logsumexp of its scores
    over each block of ``lse_block`` keys (``-inf`` where it sees none)."""
    B, H, Q, d = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2) * scale  # (B, H, Q, N)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask[:, None], -math.inf)
    s = torch.nn.functional.pad(s, (0, -s.shape[-1] % lse_block), value=-math.inf)
    return torch.logsumexp(s.unflatten(-1, (-1, lse_block)), dim=-1)


def poisoned(B, H, Q, N, lse_block):
    """A block_lse buffer full of NaN: any entry a kernel forgets (or writes but should not) shows."""
    return torch.full((B, H, Q, -(-N // lse_block)), math.nan)


def some_rows(B, Q):
    """lse_rows ``[B, Q]`` with rows asked and rows not (when there are two rows)."""
    rows = torch.rand(B, Q) < 0.6
    rows.view(-1)[0] = True
    if B * Q > 1:
        rows.view(-1)[-1] = False
    return rows


def check(got, want, brute_, lse_rows, dtype, what):
    """``got`` (a kernel's block_lse) equals the reference's ``want`` closely and the float64
    ``brute_`` within ``dtype``'s tolerance on the rows asked; the rows not asked still hold the
    poison, bit for bit."""
    asked = torch.ones(got.shape[0], got.shape[2], dtype=torch.bool) if lse_rows is None else lse_rows
    a = asked[:, None, :, None].expand_as(got)
    if got.numel():
        assert_close(got[a], brute_[a], dtype, f"{what} vs float64")
        assert_close(got[a], want[a], torch.float32, f"{what} vs reference")
    assert torch.isnan(got[~a]).all() and torch.equal(got[~a].view(torch.int32), want[~a].view(torch.int32)), (
        f"{what}: a row not asked was written"
    )


def _fp8(B, H_kv, N, d, groups, amp=3.0):
    """fp8 rows ``[B, H_kv, N, d]`` (e4m3, as the cache stores them, some all zero) and their
    bf16 scales ``[B, H_kv, N, groups]``."""
    x = torch.randn(B, H_kv, N, d) * amp
    x[..., ::7, :] = 0.0
    xg = x.unflatten(-1, (groups, -1))
    s = (xg.abs().amax(-1) / 448).to(torch.bfloat16)
    return (xg / s.float().clamp_min(1e-30)[..., None]).flatten(-2).to(torch.float8_e4m3fn), s


# ---- the reference, against the float64 brute force (no kernel: cheap, the whole grid) ---------


@pytest.mark.parametrize("lse_block", LSE_BLOCKS)
@pytest.mark.parametrize("N,G,B,Q", [(1, 1, 1, 1), (17, 3, 2, 5), (64, 4, 1, 3), (129, 8, 3, 1), (0, 4, 2, 2)])
def test_reference_equals_brute_force(N, G, B, Q, lse_block):
    H_kv, d = 2, 32
    q, k, v = torch.randn(B, G * H_kv, Q, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    q_pos = torch.linspace(0, N + 1, Q).long().expand(B, Q)  # the first row sees no key
    k_pos = (torch.arange(N) + 1)[torch.randperm(N)]
    kv_len = torch.randint(0, N + 1, (B,))
    rows = some_rows(B, Q)
    bl = poisoned(B, G * H_kv, Q, N, lse_block)
    partial_attention_ref(
        q,
        k,
        v,
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        window=N // 2 + 1,
        softcap=4.0,
        block_lse=bl,
        lse_block=lse_block,
        lse_rows=rows,
    )
    want = brute(q, k, lse_block, mask=key_mask(B, Q, N, "cpu", q_pos, k_pos, kv_len, N // 2 + 1), softcap=4.0)
    a = rows[:, None, :, None].expand_as(bl)
    assert_close(bl[a], want[a], torch.float32, "reference")
    assert torch.isnan(bl[~a]).all()


# ---- the Triton split kernel (interpreted here: each launch ~0.3 s, so few small cases) -----------

TRITON_CASES = [
    # B, G, H_kv, Q, N, d, dtype, lse_block, extra
    (1, 1, 2, 1, 1, 64, torch.float32, 1, {}),  # one key
    (3, 3, 1, 1, 127, 64, torch.float16, 16, dict(ragged=True, rows=True)),  # odd N, a row of no key
    (2, 4, 2, 5, 130, 64, torch.bfloat16, 4, dict(causal=True, rows=True, num_splits=3)),  # rows see no key
    (1, 8, 1, 1, 200, 128, torch.float32, 8, dict(sorted=True, window=40, softcap=5.0, kv_len=[170])),
    (2, 3, 1, 1, 257, 64, torch.float32, 2, dict(ragged=True, num_splits=5)),  # empty splits
    (1, 4, 1, 9, 90, 64, torch.float32, 2, dict(causal=True, rows=True)),  # G*Q = 36 fp32 rows: 3 slices
]


@pytest.mark.parametrize("B,G,H_kv,Q,N,d,dtype,lse_block,extra", TRITON_CASES)
def test_triton_block_lse(B, G, H_kv, Q, N, d, dtype, lse_block, extra):
    """Odd lengths, one key, lengths no multiple of the tile or the block, ragged lengths with a
    row of none, GQA groups 1/3/4/8, query rows that see no key, windows (searched over sorted
    positions: the runs outside it are -inf too) and soft-capping, forced splits (some empty),
    query slices; against the reference and the float64 brute force, lse_rows honoured."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    H = G * H_kv
    q, k, v = (
        torch.randn(B, H, Q, d).to(dtype),
        torch.randn(B, H_kv, N, d).to(dtype),
        torch.randn(B, H_kv, N, d).to(dtype),
    )
    kw = dict(window=extra.get("window"), softcap=extra.get("softcap"))
    if extra.get("causal"):
        kw.update(q_pos=torch.linspace(0, N + 1, Q).long().expand(B, Q), k_pos=(torch.arange(N) + 2)[torch.randperm(N)])
    if extra.get("sorted"):
        kw.update(q_pos=torch.full((B, Q), N + 1), k_pos=torch.arange(N).expand(B, N))
    if extra.get("ragged"):
        kw["kv_len"] = torch.tensor([N] + [int(x) for x in torch.randint(1, N, (B - 2,))] + [0])[:B]
    if "kv_len" in extra:
        kw["kv_len"] = torch.tensor(extra["kv_len"])
    rows = some_rows(B, Q) if extra.get("rows") else None
    bl, br = poisoned(B, H, Q, N, lse_block), poisoned(B, H, Q, N, lse_block)
    o, lse = pt.partial_attention_triton(
        q,
        k,
        v,
        block_lse=bl,
        lse_block=lse_block,
        lse_rows=rows,
        num_splits=extra.get("num_splits"),
        k_pos_sorted=bool(extra.get("sorted")),
        **kw,
    )
    ro, rl = partial_attention_ref(q, k, v, block_lse=br, lse_block=lse_block, lse_rows=rows, **kw)
    mask = key_mask(B, Q, N, "cpu", kw.get("q_pos"), kw.get("k_pos"), kw.get("kv_len"), kw["window"])
    check(bl, br, brute(q, k, lse_block, mask=mask, softcap=kw["softcap"]), rows, dtype, "block_lse")
    assert_close(lse, rl, torch.float32, "lse")  # the attention itself is untouched
    assert_close(o.float(), ro.float(), dtype, "o")


@pytest.mark.parametrize(
    "B,G,H_kv,Q,N,d,groups,dtype,lse_block,extra",
    [
        (2, 4, 2, 1, 300, 64, 2, torch.float32, 4, dict(window=90, softcap=20.0)),  # decode, ragged
        (1, 2, 1, 3, 150, 64, 1, torch.bfloat16, 16, dict(positions=False)),  # no positions: the other store
    ],
)
def test_triton_block_lse_over_fp8_rows(monkeypatch, B, G, H_kv, Q, N, d, groups, dtype, lse_block, extra):
    """The fp8 branch of the kernel (issue 27's scale groups): the scores of the values the fp8
    rows stand for, through their k_scale; nothing dequantized up front."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    def refuse(*a, **k):
        raise AssertionError("the fp8 rows were dequantized up front")

    monkeypatch.setattr(pt, "dequantize", refuse)
    H = G * H_kv
    q = torch.randn(B, H, Q, d).to(dtype)
    (k8, ks), (v8, vs) = _fp8(B, H_kv, N, d, groups), _fp8(B, H_kv, N, d, groups, amp=1.0)
    kw = dict(kv_len=torch.tensor([N, N // 2 + 1][:B]) if B > 1 else torch.tensor([N - 7]), **extra)
    if kw.pop("positions", True):
        kw.update(q_pos=torch.arange(N + 2 - Q, N + 2).expand(B, Q), k_pos=torch.arange(N).expand(B, N))
    rows = some_rows(B, Q)
    bl, br = poisoned(B, H, Q, N, lse_block), poisoned(B, H, Q, N, lse_block)
    pt.partial_attention_triton(
        q,
        k8,
        v8,
        k_scale=ks,
        v_scale=vs,
        k_pos_sorted="q_pos" in kw,
        block_lse=bl,
        lse_block=lse_block,
        lse_rows=rows,
        **kw,
    )
    partial_attention_ref(q, k8, v8, k_scale=ks, v_scale=vs, block_lse=br, lse_block=lse_block, lse_rows=rows, **kw)
    k = dequantize(k8, ks, torch.float32)
    mask = key_mask(B, Q, N, "cpu", kw.get("q_pos"), kw.get("k_pos"), kw["kv_len"], extra.get("window"))
    check(bl, br, brute(q.float(), k, lse_block, mask=mask, softcap=extra.get("softcap")), rows, dtype, "fp8")


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_paged_block_lse(fp8):
    """Through block tables (issue 35): each row's keys are its table's blocks in order (blocks
    all over the pool, two tiles a block, an empty table, a row shorter than its table), windows
    over the pool's positions; against the reference over the gathered rows (the paged
    reference's own definition) and the float64 brute force."""
    pytest.importorskip("triton")
    from treeattn_kernels.partial_triton import partial_attention_triton_paged

    d, H_kv, G, page, nb, B, Q, lse_block = 64, 2, 4, 32, 3, 3, 2, 8
    blocks = 10
    kv = (
        [_fp8(blocks, H_kv, page, d, 2), _fp8(blocks, H_kv, page, d, 2, amp=1.0)]
        if fp8
        else [(torch.randn(blocks, H_kv, page, d), None), (torch.randn(blocks, H_kv, page, d), None)]
    )
    (k_pool, ks), (v_pool, vs) = kv
    tables = torch.randperm(blocks)[: B * nb].view(B, nb).to(torch.int32)
    kv_len = torch.tensor([nb * page, 2 * page + 5, 0])
    pos_pool = torch.arange(blocks * page).view(blocks, page)  # only what each table gathers matters
    k_pos = gather_pages(pos_pool, tables)  # (B, nb * page)
    q_pos = torch.stack([k_pos[b, max(0, int(kv_len[b]) - 1)] + torch.arange(Q) for b in range(B)])
    q = torch.randn(B, G * H_kv, Q, d)
    N = nb * page
    rows = some_rows(B, Q)
    scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    bl, br = poisoned(B, G * H_kv, Q, N, lse_block), poisoned(B, G * H_kv, Q, N, lse_block)
    partial_attention_triton_paged(
        q,
        k_pool,
        v_pool,
        tables,
        kv_len,
        q_pos=q_pos,
        pos_pool=pos_pool,
        window=50,
        softcap=30.0,
        num_splits=3,
        block_n=16,
        block_lse=bl,
        lse_block=lse_block,
        lse_rows=rows,
        **scales,
    )
    k = gather_pages(k_pool, tables)
    dense = dict(k_scale=gather_pages(ks, tables), v_scale=gather_pages(vs, tables)) if fp8 else {}
    partial_attention_ref(
        q,
        k,
        gather_pages(v_pool, tables),
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        window=50,
        softcap=30.0,
        block_lse=br,
        lse_block=lse_block,
        lse_rows=rows,
        **dense,
    )
    kf = dequantize(k, dense["k_scale"]) if fp8 else k
    mask = key_mask(B, Q, N, "cpu", q_pos, k_pos, kv_len, 50)
    check(bl, br, brute(q, kf, lse_block, mask=mask, softcap=30.0), rows, torch.float32, "paged")


def test_triton_without_block_lse_is_the_kernel_it_was(monkeypatch):
    """No block_lse: LSE_BLOCK = 0 (the block_lse code compiled out, nothing stored), and the
    attention with block_lse asked is the same, bit for bit, as without."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    seen = []
    real = pt.launch

    def spy(kernel, grid, *args, **kw):
        if kernel is pt._split_kernel:
            seen.append(kw["LSE_BLOCK"])
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(pt, "launch", spy)
    q, k, v = torch.randn(2, 8, 3, 64), torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64)
    kw = dict(q_pos=torch.tensor([40, 70, 99]), k_pos=torch.arange(100), kv_len=torch.tensor([100, 61]))
    o, lse = pt.partial_attention_triton(q, k, v, **kw)
    bl = poisoned(2, 8, 3, 100, 4)
    o2, lse2 = pt.partial_attention_triton(q, k, v, block_lse=bl, lse_block=4, **kw)
    assert seen == [0, 4]
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert not torch.isnan(bl).any()


# ---- the identity citations rest on ----------------------------------------------------------


def test_block_shares_sum_to_one_on_one_shard_and_across_two():
    """exp(block_lse - lse) summed over a row's blocks is 1 for every row that sees a key (no
    sink): on one shard with its own lse, and on two shards whose lse are merged (logaddexp),
    the blocks of both together; each block's share equals the float64 softmax mass of its
    keys. Rows that see no key have every block at -inf. Through the dispatcher (Triton)."""
    pytest.importorskip("triton")
    B, G, H_kv, Q, N, d, lb, cut = 2, 4, 1, 3, 150, 64, 16, 70  # the cut inside a block of 16
    q, k, v = torch.randn(B, G * H_kv, Q, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    q_pos, k_pos = torch.tensor([0, 80, 200]), (torch.arange(N) + 1)[torch.randperm(N)]  # row 0 sees nothing
    bl = poisoned(B, G * H_kv, Q, N, lb)
    _, lse = partial_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, block_lse=bl, lse_block=lb, impl="triton")
    seen = torch.isfinite(lse)
    assert not seen[:, :, 0].any() and seen[:, :, 1:].all()
    share = torch.exp(bl - lse[..., None])  # (B, H, Q, NB)
    assert_close(share.sum(-1)[seen], torch.ones(int(seen.sum())), torch.float32, "one shard")
    assert torch.isneginf(bl[~seen]).all()

    parts = []
    for a, b in ((0, cut), (cut, N)):
        blp = poisoned(B, G * H_kv, Q, b - a, lb)
        _, lp = partial_attention(
            q, k[:, :, a:b], v[:, :, a:b], q_pos=q_pos, k_pos=k_pos[a:b], block_lse=blp, lse_block=lb, impl="triton"
        )
        parts.append((blp, lp))
    merged = torch.logaddexp(parts[0][1], parts[1][1])
    assert_close(merged[seen], lse[seen], torch.float32, "merged lse")
    shares = torch.cat([torch.exp(blp - merged[..., None]) for blp, _ in parts], dim=-1)
    assert_close(shares.sum(-1)[seen], torch.ones(int(seen.sum())), torch.float32, "two shards")
    # the share of each block of the first shard is the float64 softmax mass of its keys
    s = brute(q, k, 1, mask=key_mask(B, Q, N, "cpu", q_pos, k_pos))[..., 0:cut]  # per-key scores
    lse64 = brute(q, k, N, mask=key_mask(B, Q, N, "cpu", q_pos, k_pos))  # (B, H, Q, 1)
    mass = torch.exp(s - lse64)
    mass = torch.nn.functional.pad(mass, (0, -cut % lb)).unflatten(-1, (-1, lb)).sum(-1)  # (B, H, Q, 5)
    first = torch.exp(parts[0][0] - merged[..., None])
    assert_close(first[seen], mass[seen].float(), torch.float32, "block shares")


def test_empty_shards_and_rows_of_no_key():
    """N = 0: block_lse has no entry and nothing runs; keys but none live (kv_len 0 everywhere):
    every asked entry is -inf, never NaN, the others untouched."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    q = torch.randn(2, 4, 2, 64)
    e = torch.empty(2, 2, 0, 64)
    bl = torch.empty(2, 4, 2, 0)
    o, lse = pt.partial_attention_triton(q, e, e, block_lse=bl, lse_block=4)
    assert torch.isneginf(lse).all() and not o.any()
    k = torch.randn(2, 2, 40, 64)
    rows = torch.tensor([[True, False], [False, True]])
    bl = poisoned(2, 4, 2, 40, 16)
    pt.partial_attention_triton(q, k, k, kv_len=torch.tensor([0, 0]), block_lse=bl, lse_block=16, lse_rows=rows)
    a = rows[:, None, :, None].expand_as(bl)
    assert torch.isneginf(bl[a]).all() and torch.isnan(bl[~a]).all()


def test_bad_block_lse_is_refused():
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 33, 64)
    for bad, kw in [
        ("blocks of", dict(block_lse=torch.empty(1, 4, 1, 33), lse_block=2)),  # 17 blocks of 2
        ("fp32", dict(block_lse=torch.empty(1, 4, 1, 33, dtype=torch.float64))),
        ("lse_block must be one of", dict(block_lse=torch.empty(1, 4, 1, 11), lse_block=3)),
        ("lse_rows must be bool", dict(block_lse=torch.empty(1, 4, 1, 33), lse_rows=torch.ones(1, 1))),
    ]:
        with pytest.raises(ValueError, match=bad):
            pt.partial_attention_triton(q, k, k, **kw)
