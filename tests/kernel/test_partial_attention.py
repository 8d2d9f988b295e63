"""partial_attention: torch reference and Triton kernel against a float64 oracle."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import assert_close, attention_f64
from treeattn_kernels import partial_attention, partial_attention_ref
from treeattn_kernels.partial_ref import key_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(B, H, H_kv, Q, N, d, dtype):
    q = torch.randn(B, H, Q, d, dtype=dtype)
    k = torch.randn(B, H_kv, N, d, dtype=dtype)
    v = torch.randn(B, H_kv, N, d, dtype=dtype)
    return q, k, v


def poisoned(B, H, Q, d, dtype):
    """Output buffers filled with NaN: any element the kernel forgets to write shows up."""
    return (torch.full((B, H, Q, d), math.nan, dtype=dtype), torch.full((B, H, Q), math.nan, dtype=torch.float32))


def run_case(impl, B, G, H_kv, Q, N, d, dtype, causal, ragged, **kw):
    H = G * H_kv
    q, k, v = make(B, H, H_kv, Q, N, d, dtype)
    q_pos = k_pos = kv_len = None
    if causal:  # queries are the last Q positions of a sequence of N + offset tokens
        offset = 3
        q_pos = torch.arange(N + offset - Q, N + offset).expand(B, Q)  # some rows see no key
        k_pos = torch.arange(N)[torch.randperm(N)]  # key order within a shard is arbitrary
    if ragged:
        kv_len = torch.randint(0, N + 1, (B,))
        kv_len[0] = N
    out, lse_out = poisoned(B, H, Q, d, dtype)
    o, lse = partial_attention(
        q, k, v, q_pos=q_pos, k_pos=k_pos, kv_len=kv_len, out=out, lse_out=lse_out, impl=impl, **kw
    )
    assert o.data_ptr() == out.data_ptr() and lse.data_ptr() == lse_out.data_ptr()
    mask = key_mask(B, Q, N, q.device, q_pos, k_pos, kv_len, kw.get("window"))
    o_ref, lse_ref = attention_f64(q, k, v, mask=mask, softcap=kw.get("softcap"))
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, torch.float32 if dtype == torch.float32 else dtype, "lse")
    return o, lse


# The full grid of the issue for the (fast) torch reference.
REF_GRID = list(
    itertools.product(
        [1, 2, 127, 128, 129, 1000],  # N
        [64, 128],  # d
        [1, 3, 4, 8],  # G = H / H_kv
        [1, 3],  # B
        [1, 5],  # Q
    )
)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,d,G,B,Q", REF_GRID)
def test_reference_and_cpu_grid(N, d, G, B, Q, dtype, impl):
    causal = (N + d + G + B + Q) % 2 == 0  # half the grid causal, half ragged
    run_case(impl, B, G, 2 if G < 8 else 1, Q, N, d, dtype, causal=causal, ragged=not causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "Q,N,q0,k0,ragged",
    [
        (5, 5, 0, 0, False),
        (7, 7, 100, 100, True),
        (1, 9, 8, 8, True),
        (3, 40, 37, 37, False),
        (6, 40, 0, 0, False),  # causal diagonal blocks
        (4, 30, 29, 0, True),
        (2, 30, 90, 10, False),  # every key in the past
        (4, 30, 10, 0, False),
        (4, 30, 0, 2, False),  # offset masks: the reference path
    ],
)
def test_cpu_fast_path_shapes(Q, N, q0, k0, ragged, dtype):
    """The fused path's own cases: the causal diagonal block (one call per group head), keys
    all in the past, ragged lengths; and a non-contiguous/offset mask (falls back)."""
    B, G, H_kv, d = 3, 4, 2, 64
    q, k, v = make(B, G * H_kv, H_kv, Q, N, d, dtype)
    q_pos, k_pos = torch.arange(q0, q0 + Q), torch.arange(k0, k0 + N)
    kv_len = torch.tensor([N, max(Q, N - 1), N]) if ragged else None
    out, lse_out = poisoned(B, G * H_kv, Q, d, dtype)
    o, lse = partial_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, kv_len=kv_len, impl="cpu", out=out, lse_out=lse_out)
    mask = key_mask(B, Q, N, q.device, q_pos, k_pos, kv_len)
    o_ref, lse_ref = attention_f64(q, k, v, mask=mask)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, torch.float32 if dtype == torch.float32 else dtype, "lse")


# The interpreted Triton kernel: small shapes that still break kernels (each launch ~0.1-1 s).
TRITON_CASES = [
    # B, G, H_kv, Q, N, d, dtype, causal, ragged, extra
    (1, 1, 2, 1, 1, 64, torch.float32, False, False, {}),
    (1, 4, 2, 1, 2, 64, torch.bfloat16, False, False, {}),
    (3, 3, 1, 1, 127, 64, torch.float16, False, True, {}),
    (1, 8, 1, 1, 129, 128, torch.bfloat16, True, False, {}),
    (3, 1, 2, 5, 128, 64, torch.float32, True, True, {}),
    (1, 4, 2, 5, 300, 128, torch.float32, True, False, {"num_splits": 3}),
    (2, 3, 1, 1, 257, 64, torch.float32, False, True, {"num_splits": 5}),
    (1, 4, 1, 5, 200, 64, torch.float32, True, False, {"window": 40}),
    (1, 2, 2, 1, 150, 64, torch.float32, False, False, {"softcap": 5.0}),
    (2, 4, 1, 70, 90, 64, torch.float32, True, True, {}),  # G*Q = 280 rows: sliced queries
]


@pytest.mark.parametrize("B,G,H_kv,Q,N,d,dtype,causal,ragged,extra", TRITON_CASES)
def test_triton_kernel(B, G, H_kv, Q, N, d, dtype, causal, ragged, extra):
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    if "num_splits" in extra:  # split count forced: empty and partial splits both happen
        q, k, v = make(B, G * H_kv, H_kv, Q, N, d, dtype)
        kv_len = torch.randint(0, N + 1, (B,)) if ragged else None
        o, lse = pt.partial_attention_triton(q, k, v, kv_len=kv_len, num_splits=extra["num_splits"])
        o_ref, lse_ref = partial_attention_ref(q, k, v, kv_len=kv_len)
        assert_close(o, o_ref, dtype, "o")
        assert_close(lse, lse_ref, torch.float32, "lse")
        return
    run_case("triton", B, G, H_kv, Q, N, d, dtype, causal, ragged, **extra)


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_window_and_softcap(impl):
    if impl == "triton":
        pytest.importorskip("triton")
    run_case(impl, 2, 2, 2, 3, 90, 64, torch.float32, causal=True, ragged=True, window=17, softcap=3.0)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_softcap_compiled_in_or_out(monkeypatch, softcap):
    """Under a Triton whose Hopper pipeliner fails on a runtime branch on the scores (3.5, 3.6:
    every prefill tile failed to compile on an H100), soft-capping is a compile-time flag: the
    kernel compiled with it in (1) or out (-1) still equals the reference, and the flag is the
    one the launch chose."""
    pytest.importorskip("triton")
    from treeattn_kernels import partial_triton as pt

    monkeypatch.setattr(pt, "PIPELINER_NEEDS_STATIC_SOFTCAP", True)
    assert pt.softcap_mode(softcap) == (1 if softcap else -1)
    run_case("triton", 2, 2, 2, 3, 90, 64, torch.float32, causal=True, ragged=True, window=17, softcap=softcap)
    monkeypatch.setattr(pt, "PIPELINER_NEEDS_STATIC_SOFTCAP", False)
    assert pt.softcap_mode(softcap) == 0


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_empty_shard_and_no_visible_key(impl):
    """N = 0, and every key in the future: o = 0 and lse = -inf, never NaN."""
    if impl == "triton":
        pytest.importorskip("triton")
    q, k, v = make(2, 4, 2, 1, 0, 64, torch.float32)
    o, lse = partial_attention(q, k, v, impl=impl)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    q, k, v = make(2, 4, 2, 1, 10, 64, torch.float32)
    o, lse = partial_attention(q, k, v, q_pos=torch.tensor([5]), k_pos=torch.arange(10, 20), impl=impl)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_gqa_never_repeats_kv(monkeypatch):
    """The reference must not expand K/V to H heads (memory and bytes x group size)."""
    calls = []
    orig = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: calls.append(1) or orig(*a, **k))
    q, k, v = make(1, 8, 2, 1, 16, 64, torch.float32)
    partial_attention_ref(q, k, v)
    assert not calls


def test_reference_slices_long_query_blocks(monkeypatch):
    """Query rows are processed in slices under the score-size bound, with the same result."""
    import treeattn_kernels.partial_ref as pr

    q, k, v = make(2, 4, 2, 37, 50, 64, torch.float32)
    qp, kp = torch.arange(13, 50), torch.arange(50)
    full = pr.partial_attention_ref(q, k, v, q_pos=qp, k_pos=kp)
    monkeypatch.setattr(pr, "_MAX_SCORE_ELEMS", 2 * 4 * 50 * 5)  # 5 rows per slice
    sliced = pr.partial_attention_ref(q, k, v, q_pos=qp, k_pos=kp)
    assert torch.equal(full[0], sliced[0]) and torch.equal(full[1], sliced[1])


@pytest.mark.parametrize("bad", ["heads", "batch", "pos", "len"])
def test_bad_shapes_raise_clearly(bad):
    q, k, v = make(2, 6, 3, 1, 8, 64, torch.float32)
    kw = {}
    if bad == "heads":
        k, v = torch.randn(2, 4, 8, 64), torch.randn(2, 4, 8, 64)  # 6 query heads, 4 KV heads
    elif bad == "batch":
        q = q[:1]
    elif bad == "pos":
        kw = {"q_pos": torch.arange(2), "k_pos": torch.arange(8)}
    elif bad == "len":
        kw = {"kv_len": torch.tensor([1, 2, 3])}
    with pytest.raises(ValueError):
        partial_attention_ref(q, k, v, **kw)


def test_the_plan_does_not_depend_on_the_batch_or_the_rows():
    """Issue 49: the split kernel's tile and splits are the same for any batch and any number of
    query rows (a decode step, a verify of drafts, a question's slice), on every target: only
    the grid grows with the keys it must cover."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt
    from treeattn_kernels.targets import TARGETS

    for t in TARGETS.values():
        for dtype in (torch.bfloat16, torch.float32):
            for fixed in (False, True):
                plans = {
                    pt.plan_split(B, 8, 4, Q, N, 128, dtype, t, fixed_splits=fixed)
                    for B in (1, 3, 32, 200)
                    for Q in (1, 2, 9, 16)
                    for N in (1 << 20,)
                }
                assert len(plans) == 1, (t.name, dtype, fixed, plans)
                p = plans.pop()
                assert p.split_min == p.block_n * p.depth  # a split keeps the kernel's pipeline full
                assert p.split_len == (p.split_min if fixed else 0)


# A wider sample of the grid through the interpreted kernel: every N/d/G, dtypes rotating.
TRITON_GRID = [
    (N, d, G, 3 if i % 2 else 1, 5 if i % 3 == 0 else 1, DTYPES[i % 3])
    for i, (N, d, G) in enumerate(itertools.product([1, 129, 1000], [64, 128], [1, 3, 4, 8]))
]


@pytest.mark.parametrize("N,d,G,B,Q,dtype", TRITON_GRID)
def test_triton_grid(N, d, G, B, Q, dtype):
    pytest.importorskip("triton")
    causal = (N + G) % 2 == 0
    run_case("triton", B, G, 8 // G if G < 8 else 1, Q, N, d, dtype, causal=causal, ragged=not causal)


@pytest.mark.parametrize("Q,window", [(1, 100), (1, None), (40, 100)])
def test_triton_never_reads_blocks_no_query_sees(Q, window):
    """Sliding-window and causal layers skip whole key blocks that no query of the tile can
    see (Gemma-3's 1024 window at 128K read ~128x too much). Such blocks are poisoned with NaN
    here: a kernel that loads them gets NaN (0 x NaN in p @ v), one that skips them does not."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    B, G, H_kv, N, d = 1, 4, 2, 1000, 64
    q, k, v = make(B, G * H_kv, H_kv, Q, N, d, torch.float32)
    q_pos = torch.arange(N - Q, N) if window else torch.arange(300, 300 + Q)  # causal: 300+ are future
    k_pos = torch.arange(N)
    o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window)
    if window:  # blocks of 64 keys entirely before the window of the earliest query
        dead = slice(0, (N - Q - window) // 64 * 64)
    else:  # blocks entirely after the latest query
        dead = slice((300 + Q + 63) // 64 * 64, N)
    assert dead.stop - dead.start >= 128
    k[:, :, dead], v[:, :, dead] = math.nan, math.nan
    o, lse = pt.partial_attention_triton(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window, block_n=64)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


@pytest.mark.parametrize("kind", ["base2", "garbage"])
def test_fused_path_checks_the_base_of_its_lse(monkeypatch, kind):
    """ROCm's flash kernel returned a base-2 logsumexp before torch 2.8 (pytorch#156012): the
    fused path measures the base once and converts; an LSE in neither base is not trusted
    (the reference runs instead). Simulated by wrapping the CPU op."""
    import treeattn_kernels.partial_aten as pa

    real = pa._OP_CPU

    def fake(q, k, v, dropout, causal, scale=None):
        o, lse, *rest = real(q, k, v, dropout, causal, scale=scale)
        return (o, lse / math.log(2.0) if kind == "base2" else lse * 0 + 7.0, *rest)

    monkeypatch.setattr(pa, "_OP_CPU", fake)
    monkeypatch.setattr(pa, "_LSE_BASE", {})
    q, k, v = make(2, 4, 2, 3, 50, 64, torch.float32)
    o, lse = pa.partial_attention_aten(q, k, v)
    o_ref, lse_ref = attention_f64(q, k, v)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert pa._LSE_BASE[("cpu", torch.float32)] == (math.log(2.0) if kind == "base2" else None)


def test_fused_causal_blocks_are_square(monkeypatch):
    """A causal block with fewer queries than keys (queries and keys starting at the same
    position) reaches the fused kernel as a square block: FA2 aligns a non-square causal mask
    bottom-right, the opposite of ours, so a non-square causal call would be wrong on GPUs."""
    import treeattn_kernels.partial_aten as pa

    real, calls = pa._OP_CPU, []

    def spy(q, k, v, dropout, causal, scale=None):
        calls.append((causal, q.shape[2], k.shape[2]))
        return real(q, k, v, dropout, causal, scale=scale)

    monkeypatch.setattr(pa, "_OP_CPU", spy)
    monkeypatch.setattr(pa, "_LSE_BASE", {("cpu", torch.float32): 1.0})
    Q, N = 6, 40
    q, k, v = make(2, 4, 2, Q, N, 64, torch.float32)
    pos = dict(q_pos=torch.arange(Q), k_pos=torch.arange(N))
    o, lse = pa.partial_attention_aten(q, k, v, kv_len=torch.tensor([N, 3]), **pos)
    assert calls and all(qn == kn for causal, qn, kn in calls if causal), calls
    o_ref, lse_ref = attention_f64(q, k, v, mask=key_mask(2, Q, N, "cpu", kv_len=torch.tensor([N, 3]), **pos))
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


def _sink_oracle(q, k, v, sink, mask=None):
    """float64 attention with a learned per-head sink logit in every softmax denominator (as
    gpt-oss's eager attention: a column of logits that is dropped after the softmax)."""
    B, H, Q, d = q.shape
    G = H // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(d)  # (B, H, Q, N)
    if mask is not None:
        s = s.masked_fill(~mask[:, None], -math.inf)
    col = sink.double().view(1, H, 1, 1).expand(B, H, Q, 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return p @ v.double().repeat_interleave(G, 1), torch.logsumexp(torch.cat([s, col], -1), -1)


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("N,ragged", [(0, False), (1, False), (77, True), (300, False)])
def test_sinks_enter_the_denominator_once(impl, N, ragged):
    """``sink``: exp(sink[h]) joins head h's softmax denominator (rows without a key keep o = 0
    and get lse = sink), and a partial with the sink merged with partials without it equals
    attention with the sink over all keys."""
    if impl == "triton":
        pytest.importorskip("triton")
    B, G, H_kv, Q, d = 2, 3, 2, 1, 32
    H = G * H_kv
    q, k, v = make(B, H, H_kv, Q, N, d, torch.float32)
    sink = torch.randn(H) * 2 + 1
    kv_len = torch.tensor([N, N // 2]) if ragged else None
    o, lse = partial_attention(q, k, v, kv_len=kv_len, sink=sink, impl=impl)
    mask = key_mask(B, Q, N, q.device, None, None, kv_len) if ragged else None
    o_ref, lse_ref = _sink_oracle(q, k, v, sink, mask)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    if N >= 2:  # split the keys: the sink in one partial only
        from treeattn_cli.parallel.merge import merge_pair

        a, b = (
            partial_attention(q, k[:, :, : N // 2], v[:, :, : N // 2], sink=sink, impl=impl),
            partial_attention(q, k[:, :, N // 2 :], v[:, :, N // 2 :], impl=impl),
        )
        mo, ml = merge_pair(*a, *b)
        o_all, l_all = _sink_oracle(q, k, v, sink)
        assert_close(mo, o_all, torch.float32, "merged o")
        assert_close(ml, l_all, torch.float32, "merged lse")


def test_reference_bounds_its_memory_by_rows_and_keys(monkeypatch):
    """The reference (the fallback after a failed self-check) never builds a score block or a
    mask larger than its bound, whatever Q x N (a 64K x 64K causal prefill block once needed a
    32 GiB int64 mask): rows in slices, keys in blocks merged by LSE, the same answer."""
    from treeattn_kernels import partial_ref as pr

    monkeypatch.setattr(pr, "_MAX_SCORE_ELEMS", 4096)
    monkeypatch.setattr(pr, "_KEY_BLOCK", 50)
    biggest = [0]
    real = pr.key_mask

    def watched(*a, **kw):
        m = real(*a, **kw)
        biggest[0] = max(biggest[0], 0 if m is None else m.numel())
        return m

    monkeypatch.setattr(pr, "key_mask", watched)
    B, G, H_kv, Q, N, d = 1, 2, 2, 70, 333, 16
    q, k, v = make(B, G * H_kv, H_kv, Q, N, d, torch.float32)
    q_pos, k_pos = torch.arange(N - Q, N), torch.arange(N)[torch.randperm(N)]
    o, lse = pr.partial_attention_ref(q, k, v, q_pos=q_pos, k_pos=k_pos, window=100, kv_len=torch.tensor([300]))
    mask = real(B, Q, N, q.device, q_pos, k_pos, torch.tensor([300]), 100)
    o_ref, lse_ref = attention_f64(q, k, v, mask=mask)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert 0 < biggest[0] <= 4096 // (G * H_kv), biggest[0]  # a slice of rows x one key block, never Q x N


def test_one_split_copy_is_the_reduce_bit_for_bit(monkeypatch):
    """Under Triton's interpreter a call of one split with fp32 partials out (every call of the
    engine's) copies its partial instead of running the reduce kernel (a Python program per row
    there): the same bits as the kernel, an empty row (no key) and zeros included, in the
    output's strides; and it is taken (a 16-bit output still runs the reduce)."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    B, G, H_kv, Q, N, d = 2, 2, 2, 3, 40, 32
    q, k, v = make(B, G * H_kv, H_kv, Q, N, d, torch.float32)
    v[0, 0, :, 5] = 0.0  # a column of zeros: o's element is 0 (the reduce makes any -0.0 a +0.0)
    v[0, 1, :, 6] = -0.0
    kv_len = torch.tensor([N, 0])  # the second row sees no key
    names = []
    real = pt.launch
    monkeypatch.setattr(
        pt, "launch", lambda kernel, grid, *a, **kw: names.append(kernel.fn.__name__) or real(kernel, grid, *a, **kw)
    )
    runs = {}
    for on in (True, False):
        monkeypatch.setitem(pt.ONE_SPLIT_COPY, "on", on)
        out = torch.empty(B, Q, G * H_kv, d).transpose(1, 2)  # the layer's layout: strided
        o, lse = pt.partial_attention_triton(q, k, v, kv_len=kv_len, out=out)
        runs[on] = (o.clone(), lse.clone())
    assert names == ["_split_kernel", "_split_kernel", "_reduce_kernel"], names
    assert torch.equal(runs[True][0].view(torch.int32), runs[False][0].view(torch.int32))
    assert torch.equal(runs[True][1].view(torch.int32), runs[False][1].view(torch.int32))
    assert torch.isinf(runs[True][1][1]).all()
    names.clear()
    pt.partial_attention_triton(q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_len=kv_len)
    assert names == ["_split_kernel", "_reduce_kernel"], names


# ---- issue 23: split lengths follow the live length; window layers read the window --------


@pytest.mark.parametrize("num_splits", [3, 5])
def test_triton_splits_follow_the_live_length(monkeypatch, num_splits):
    """Splits are planned on the capacity (a CUDA graph's shapes) but cut from each row's own
    live length on the device: with 1000 keys of capacity and 300 live, every split of that row
    gets work (the split length used to be the capacity's: half the splits exited at once)."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    seen = {}
    real = pt.launch

    def spy(kernel, grid, *args, **kw):
        if kernel is pt._split_kernel:
            seen["lp"] = args[7]  # the per-split lse partials [B, H, Q, NSPLIT]
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(pt, "launch", spy)
    B, G, H_kv, N, d = 2, 4, 1, 1000, 64
    q, k, v = make(B, G * H_kv, H_kv, 1, N, d, torch.float32)
    kv_len = torch.tensor([300, 1000])
    o, lse = pt.partial_attention_triton(q, k, v, kv_len=kv_len, num_splits=num_splits)
    lp = seen["lp"]
    assert lp.shape[-1] == num_splits
    assert torch.isfinite(lp[0]).all(), lp[0, 0, 0]  # 300 keys = 5 blocks >= splits: none empty
    o_ref, lse_ref = partial_attention_ref(q, k, v, kv_len=kv_len)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


@pytest.mark.parametrize(
    "Q,N,window,gaps,ragged,q_off",
    [
        (1, 3000, 77, 3, True, 3),  # a rank's chunks: ascending positions with gaps
        (3, 700, 50, 2, False, -400),  # queries inside the shard: later keys are in their future
        (5, 700, None, 2, True, -100),  # causal only: the search bounds the causal end
        (1, 700, 10, 1, False, -800),  # no key visible
    ],
)
def test_triton_sorted_positions_search(Q, N, window, gaps, ragged, q_off):
    """``k_pos_sorted``: each program finds its live keys by a search over the ascending
    positions; the same answer as the reference whatever the queries see."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    B, G, H_kv, d = 2, 2, 2, 32
    q, k, v = make(B, G * H_kv, H_kv, Q, N, d, torch.float32)
    k_pos = torch.sort(torch.randperm(N * gaps)[:N]).values if gaps > 1 else torch.arange(N)
    top = int(k_pos[-1]) + q_off
    q_pos = torch.arange(top - Q + 1, top + 1)
    kv_len = torch.tensor([N, N // 3]) if ragged else None
    o, lse = pt.partial_attention_triton(
        q, k, v, q_pos=q_pos, k_pos=k_pos, kv_len=kv_len, window=window, k_pos_sorted=True
    )
    o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=q_pos, k_pos=k_pos, kv_len=kv_len, window=window)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")


def _count_loads(monkeypatch, **watch) -> dict:
    """Count the elements every masked load of the interpreted kernel reads, by kind: ``pos``
    (int64 positions), ``kv`` (64-key K/V tiles), ``other``; and, for each tensor of ``watch``
    (name=tensor), the elements read from its storage."""
    import numpy as np
    import triton.runtime.interpreter as interp

    count = {}
    real = interp.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, *a, **kw):
        kind = (
            "pos"
            if str(ptrs.get_element_ty()) == "int64"
            else "kv"
            if mask.data.ndim == 2 and mask.data.shape[0] == 64
            else "other"
        )
        count[kind] = count.get(kind, 0) + int(np.count_nonzero(mask.data))
        for name, t in watch.items():
            lo = t.data_ptr()
            inside = (ptrs.data >= lo) & (ptrs.data < lo + t.numel() * t.element_size())
            count[name] = count.get(name, 0) + int(np.count_nonzero(mask.data & inside))
        return real(self, ptrs, mask, other, *a, **kw)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", counting)
    return count


def test_triton_window_layers_read_the_window_not_the_shard(monkeypatch):
    """H6: with positions sorted per rank (``k_pos_sorted``), a sliding-window decode reads a
    few hundred sampled positions and the window's K/V, not the shard: every load the
    interpreted kernel makes is counted. Without the promise (any key order) it reads every
    position, and still no K/V outside the window (those loads are masked off)."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    count = _count_loads(monkeypatch)
    reads = {}
    for srt, N in ((True, 60000), (False, 4000)):  # the walk is slow in the interpreter: a shorter shard
        B, G, H_kv, d, window = 1, 4, 1, 16, 100
        q, k, v = make(B, G * H_kv, H_kv, 1, N, d, torch.float32)
        k_pos, q_pos = torch.arange(N), torch.tensor([N - 1])
        o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window)
        count.clear()
        o, lse = pt.partial_attention_triton(
            q, k, v, q_pos=q_pos, k_pos=k_pos, window=window, k_pos_sorted=srt, block_n=64
        )
        assert_close(o, o_ref, torch.float32, "o")
        assert_close(lse, lse_ref, torch.float32, "lse")
        reads[srt] = dict(count, N=N)
    kv_rows = 2 * (window + 2 * 64)  # K and V rows of the window's blocks
    assert reads[True]["kv"] <= kv_rows * d and reads[False]["kv"] <= kv_rows * d, reads
    assert reads[True]["pos"] < reads[True]["N"] // 8, reads  # a search, not a walk
    assert reads[False]["pos"] >= reads[False]["N"], reads  # the walk the search replaces


@pytest.mark.parametrize("pad", [0, 2, 5])
def test_triton_padding_rows_do_not_widen_the_window(monkeypatch, pad):
    """Issue 32: a batch's ragged rows are padded at position -1 (they see no key). They set no
    bound of the tile's window: a window layer still reads the window's K/V, not the shard from
    its start (as it did when the earliest query of the tile was the padding's -1). With only
    padding rows nothing is read, and those rows come out empty."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    B, G, H_kv, d, window, N = 1, 2, 1, 16, 100, 20000
    live = [N - 3, N - 2, N - 1] if pad < 5 else []
    q_pos = torch.tensor(live + [-1] * pad)
    q, k, v = make(B, G * H_kv, H_kv, len(q_pos), N, d, torch.float32)
    count = _count_loads(monkeypatch, k=k, v=v)
    k_pos = torch.arange(N)
    o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window)
    o, lse = pt.partial_attention_triton(
        q, k, v, q_pos=q_pos, k_pos=k_pos, window=window, k_pos_sorted=True, block_n=64
    )
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert count["k"] + count["v"] <= 2 * (window + 3 * 64) * d, count
    if not live:
        assert count["k"] + count["v"] == 0 and torch.isinf(lse).all() and not o.any()


def _fp8(B, H_kv, N, d, groups, amp=3.0):
    """An fp8 K or V as a cache holds it: e4m3 rows ``[B, H_kv, N, d]`` and a bf16 scale per
    group of ``d / groups`` channels ``[B, H_kv, N, groups]`` (some rows all zero)."""
    x = torch.randn(B, H_kv, N, d) * amp
    x[..., ::7, :] = 0.0  # zero rows: a zero scale must not make NaNs
    xg = x.unflatten(-1, (groups, -1))
    s = (xg.abs().amax(-1) / 448).to(torch.bfloat16)
    x8 = (xg / s.float().clamp_min(1e-30)[..., None]).flatten(-2).to(torch.float8_e4m3fn)
    return x8, s


@pytest.mark.parametrize(
    "B,G,H_kv,Q,N,d,groups,dtype,extra",
    [
        (2, 4, 2, 1, 300, 64, 2, torch.float32, dict(window=90, softcap=20.0)),  # decode, window, softcap, ragged
        (1, 8, 1, 1, 200, 128, 4, torch.bfloat16, {}),  # Llama's group of 8, four scales a row
        (2, 2, 2, 3, 150, 96, 3, torch.float32, {}),  # three groups: padded to four in the tile
        (1, 2, 2, 40, 90, 64, 2, torch.float32, dict(window=30)),  # a query block sliced into the tile's rows
        (1, 2, 1, 1, 64, 64, 1, torch.float32, {}),  # one scale a row
    ],
)
def test_triton_reads_fp8_rows_and_their_scales(monkeypatch, B, G, H_kv, Q, N, d, groups, dtype, extra):
    """The split kernel over an fp8 cache (issue 27) loads the e4m3 tiles and their scales and
    dequantizes in registers (nothing is dequantized up front): the attention of the values the
    rows stand for, against the float64 oracle, ragged lengths and positions included."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt
    from treeattn_kernels.partial_ref import dequantize

    def refuse(*a, **k):
        raise AssertionError("the fp8 rows were dequantized up front")

    monkeypatch.setattr(pt, "dequantize", refuse)
    H = G * H_kv
    q = torch.randn(B, H, Q, d).to(dtype)
    (k8, ks), (v8, vs) = _fp8(B, H_kv, N, d, groups), _fp8(B, H_kv, N, d, groups, amp=1.0)
    q_pos = torch.arange(N + 2 - Q, N + 2).expand(B, Q)
    k_pos = torch.arange(N).expand(B, N)
    kv_len = torch.tensor([N, N // 2 + 1][:B])
    out, lse_out = poisoned(B, H, Q, d, dtype)
    o, lse = pt.partial_attention_triton(
        q,
        k8,
        v8,
        k_scale=ks,
        v_scale=vs,
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        k_pos_sorted=True,
        out=out,
        lse_out=lse_out,
        **extra,
    )
    k, v = dequantize(k8, ks, torch.float32), dequantize(v8, vs, torch.float32)
    mask = key_mask(B, Q, N, q.device, q_pos, k_pos, kv_len, extra.get("window"))
    o_ref, lse_ref = attention_f64(q.float(), k, v, mask=mask, softcap=extra.get("softcap"))
    assert_close(o, o_ref.to(dtype), dtype, "o")
    assert_close(lse, lse_ref, torch.float32 if dtype == torch.float32 else dtype, "lse")


def test_triton_fp8_groups_it_cannot_tile_are_dequantized_up_front():
    """Scale groups that are no power-of-two run of channels (two groups of 48) take the
    dequantize-first path, with the same answer; a scale of the wrong shape is refused."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt
    from treeattn_kernels.partial_ref import dequantize

    q = torch.randn(1, 4, 1, 96)
    (k8, ks), (v8, vs) = _fp8(1, 2, 70, 96, 2), _fp8(1, 2, 70, 96, 2)
    o, lse = pt.partial_attention_triton(q, k8, v8, k_scale=ks, v_scale=vs)
    o_ref, lse_ref = attention_f64(q, dequantize(k8, ks, torch.float32), dequantize(v8, vs, torch.float32))
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    with pytest.raises(ValueError, match="k_scale and v_scale must be"):
        pt.partial_attention_triton(q, k8, v8, k_scale=ks[..., :1], v_scale=vs)


@pytest.mark.parametrize("case", ["plain", "ragged+sink", "positions", "window", "block_lse", "bf16"])
def test_aten_path_dequantizes_one_key_block_at_a_time(monkeypatch, case):
    """The fused ATen path over an fp8 shard (the CPU's, and the GPU's past the split kernel's
    rows) dequantizes it for the fused kernel one block of keys at a time (a 64-key block here:
    a shard of 300 keys, five blocks), its partials merged by LSE; the paths it falls back to
    (windows: the reference) read the fp8 rows themselves, a block at a time too. No copy of the
    whole shard is ever made, and the answer is the reference's."""
    import treeattn_kernels
    from treeattn_kernels import partial_aten, partial_ref

    monkeypatch.setattr(partial_ref, "_KEY_BLOCK", 64)
    widest = []
    real = partial_ref.dequantize

    def counting(x8, scale, dtype=torch.float32):
        widest.append(x8.shape[2])
        return real(x8, scale, dtype)

    for mod in (treeattn_kernels, partial_aten, partial_ref):
        monkeypatch.setattr(mod, "dequantize", counting)
    B, G, H_kv, Q, N, d = 2, 4, 2, 5, 300, 64
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    q = torch.randn(B, G * H_kv, Q, d).to(dtype)
    (k8, ks), (v8, vs) = _fp8(B, H_kv, N, d, 2), _fp8(B, H_kv, N, d, 2, amp=1.0)
    kw = dict(k_scale=ks, v_scale=vs, kv_len=torch.tensor([N, 150]))
    if case == "ragged+sink":
        kw.update(sink=torch.randn(G * H_kv), kv_len=torch.tensor([N - 1, 0]))
    if case in ("positions", "window", "block_lse"):  # queries after the keys: some blocks causal
        kw.update(q_pos=torch.arange(N - 2, N - 2 + Q).expand(B, Q), k_pos=torch.arange(N).expand(B, N))
    if case == "window":
        kw["window"] = 100
    if case == "block_lse":
        kw.update(
            block_lse=torch.full((B, G * H_kv, Q, -(-N // 4)), math.nan),
            lse_block=4,
            lse_rows=torch.tensor([[True] * Q, [False] * Q]),
        )
    o, lse = partial_attention(q, k8, v8, impl="aten", **kw)
    assert max(widest) == 64 and widest.count(64) >= 2 * 4, widest  # K and V, block by block
    ref = dict(kw, block_lse=torch.full_like(kw["block_lse"], math.nan)) if case == "block_lse" else kw
    if dtype == torch.float32:
        o_ref, lse_ref = partial_attention_ref(q, k8, v8, **ref)
    else:  # the path's contract: rows dequantized to q's dtype (bf16 scores differ from fp32's by
        # up to ~3 % of |o| at these K amplitudes, blocked or not); blocking itself adds at most
        # one bf16 rounding of each block's partial (< 2^-8 of |o|) to the final one
        ref = {k: v for k, v in ref.items() if k not in ("k_scale", "v_scale")}
        o_ref, lse_ref = partial_attention_ref(q, real(k8, ks, dtype), real(v8, vs, dtype), **ref)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, torch.float32 if dtype == torch.float32 else dtype, "lse")
    if case == "block_lse":
        assert torch.equal(kw["block_lse"].isnan(), ref["block_lse"].isnan())
        asked = ~kw["block_lse"].isnan()
        assert_close(kw["block_lse"][asked], ref["block_lse"][asked], torch.float32, "block_lse")


def test_tritons_floor_has_every_feature_the_kernels_use(monkeypatch):
    """TRITON_FLOOR is the oldest Triton with every feature the kernels' source uses (a feature
    newer than the floor fails here), pyproject asks for that floor, and an older Triton is
    refused with one line naming both versions (then the ATen path decodes, and generate says so)."""
    import re
    import sys
    import types
    from pathlib import Path

    import treeattn_kernels as K

    src = Path(K.__file__).parent
    used = {f for f in K.TRITON_FEATURES for p in src.glob("*.py") if re.search(rf"\b{f}\b", p.read_text())}
    assert "do_not_specialize_on_alignment" in used
    assert K.TRITON_FLOOR >= max(K.TRITON_FEATURES[f] for f in used)
    root = Path(__file__).resolve().parents[2]
    floor = re.search(r'"triton>=([\d.]+)', (root / "pyproject.toml").read_text()).group(1)
    assert tuple(int(x) for x in floor.split(".")) == K.TRITON_FLOOR
    from treeattn_cli.bench import gpu_report  # its preflight may run where the kernels do not import

    assert tuple(int(x) for x in gpu_report.FLOORS["triton"].split(".")) == K.TRITON_FLOOR
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.1.0"))
    problem = K.triton_problem()
    assert problem and "Triton 3.1.0 is older than 3.2" in problem and "\n" not in problem
    assert K.triton_available() is False
