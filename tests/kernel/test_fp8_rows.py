"""fp8 KV with many query rows (issue 38): the split kernel dequantizes each K/V tile in
registers and runs the 16-bit kernel's dots on it, so all the query rows of a launch (as many
as the 16-bit kernel holds) meet each tile once: 8 sequences over one document, or a verify of
17 rows, read the fp8 shard once per launch as bf16 does (~0.53x its bytes, where expanding
each row per scale group sliced them into 2-9 launches: 1.06-2.1x). The interpreted kernel
against the float64 oracle and the reference with many rows (GQA groups of 4 and 8, ragged
lengths, windows over positions, block_lse), and the launches a step makes, counted without a
kernel."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close, attention_f64
from treeattn_kernels import partial_attention_ref
from treeattn_kernels.partial_ref import dequantize, key_mask


def _fp8(B, H_kv, N, d, groups, amp=3.0):
    """An fp8 K or V as a cache holds it: e4m3 rows ``[B, H_kv, N, d]`` and a bf16 scale per
    group of ``d / groups`` channels ``[B, H_kv, N, groups]`` (every 7th row all zero)."""
    x = torch.randn(B, H_kv, N, d) * amp
    x[..., ::7, :] = 0.0
    xg = x.unflatten(-1, (groups, -1))
    s = (xg.abs().amax(-1) / 448).to(torch.bfloat16)
    return (xg / s.float().clamp_min(1e-30)[..., None]).flatten(-2).to(torch.float8_e4m3fn), s


def _split_launches(monkeypatch, pt, run: bool = True) -> list:
    """The split kernel's launches, recorded (their BLOCK_M) as they are made (``run``; else
    no kernel runs)."""
    seen = []
    real = pt.launch

    def counting(kernel, grid, *args, **kw):
        if kernel is pt._split_kernel:
            seen.append(kw["BLOCK_M"])
        return real(kernel, grid, *args, **kw) if run else None

    monkeypatch.setattr(pt, "launch", counting)
    return seen


@pytest.mark.parametrize(
    "B,G,H_kv,Q,N,d,groups,dtype,extra",
    [
        (2, 4, 2, 8, 200, 128, 4, torch.bfloat16, {}),  # 8 sequences' rows over one document, ragged
        (1, 8, 1, 5, 150, 64, 2, torch.bfloat16, dict(window=40)),  # GQA 8, a window over positions
        (2, 4, 1, 8, 130, 96, 3, torch.float16, dict(positions=True, softcap=20.0)),  # groups padded to 4
        (1, 4, 2, 8, 140, 128, 4, torch.bfloat16, dict(lse_block=4)),  # block_lse, stored after the dots
        (1, 8, 1, 5, 100, 64, 2, torch.float16, dict(lse_block=16, positions=True)),  # ... and before them
    ],
)
def test_fp8_rows_meet_each_tile_in_one_launch(monkeypatch, B, G, H_kv, Q, N, d, groups, dtype, extra):
    """All G·Q rows of a KV head in the decode step's tile (slices of it, issue 49) over the fp8
    rows and their scales (nothing
    dequantized up front), against the float64 oracle of the values the rows stand for; with
    block_lse, each row's per-block log-sum-exp against the reference's."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    def refuse(*a, **k):
        raise AssertionError("the fp8 rows were dequantized up front")

    monkeypatch.setattr(pt, "dequantize", refuse)
    launches = _split_launches(monkeypatch, pt)
    extra = dict(extra)
    lse_block, window = extra.pop("lse_block", None), extra.get("window")
    H = G * H_kv
    q = torch.randn(B, H, Q, d).to(dtype)
    (k8, ks), (v8, vs) = _fp8(B, H_kv, N, d, groups), _fp8(B, H_kv, N, d, groups, amp=1.0)
    kw = dict(kv_len=torch.tensor([N, N // 2 + 3][:B]), softcap=extra.get("softcap"), window=window)
    if extra.get("positions") or window:  # the last Q positions, some rows seeing no key
        kw.update(q_pos=torch.arange(N + 3 - Q, N + 3).expand(B, Q), k_pos=torch.arange(N).expand(B, N))
    blocks = {}
    if lse_block:  # some rows ask, poisoned entries
        rows = torch.rand(B, Q) < 0.6
        rows[0, 0], rows[-1, -1] = True, False
        blocks = dict(block_lse=torch.full((B, H, Q, -(-N // lse_block)), math.nan), lse_block=lse_block, lse_rows=rows)
    out, lse_out = torch.full((B, H, Q, d), math.nan, dtype=dtype), torch.full((B, H, Q), math.nan)
    o, lse = pt.partial_attention_triton(
        q, k8, v8, k_scale=ks, v_scale=vs, k_pos_sorted="q_pos" in kw, out=out, lse_out=lse_out, **kw, **blocks
    )
    assert launches == [pt.tile_rows(G)] * -(-Q // (pt.tile_rows(G) // G)), launches  # the decode step's tile
    mask = key_mask(B, Q, N, q.device, kw.get("q_pos"), kw.get("k_pos"), kw["kv_len"], window)
    o_ref, lse_ref = attention_f64(q.float(), dequantize(k8, ks), dequantize(v8, vs), mask=mask, softcap=kw["softcap"])
    assert_close(o, o_ref.to(dtype), dtype, "o")
    assert_close(lse, lse_ref, dtype, "lse")
    if blocks:
        bl, br = blocks["block_lse"], torch.full_like(blocks["block_lse"], math.nan)
        partial_attention_ref(q, k8, v8, k_scale=ks, v_scale=vs, **kw, **dict(blocks, block_lse=br))
        asked = blocks["lse_rows"][:, None, :, None].expand_as(bl)
        assert_close(bl[asked], br[asked], dtype, "block_lse")
        assert torch.isnan(bl[~asked]).all(), "a row not asked was written"


# Llama-3.1-8B's heads on one rank (d = 128: four scale groups a row) at GQA groups of 4 and 8.
STEPS = {"batch 1": (1, False), "batch 8": (8, False), "verify 17": (17, True)}


@pytest.mark.parametrize("G", [4, 8])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_launches_as_many_times_over_fp8_as_over_bf16(monkeypatch, G, step):
    """The launches ``_attend`` makes per step (no kernel runs: meta tensors, ``launch``
    counted): over an fp8 cache as many as over bf16 (8 sequences' rows of one document and a
    verify of 17 rows cut into slices of the decode step's tile, issue 49), so a step reads at
    most 0.55x bf16's bytes, scales included: each launch reads the shard once."""
    pytest.importorskip("triton")
    import treeattn_kernels.partial_triton as pt

    Q, causal = STEPS[step]
    H_kv, d, N = 8, 128, 4096
    dev = "meta"
    q = torch.empty(1, H_kv * G, Q, d, dtype=torch.bfloat16, device=dev)
    kw = dict(kv_len=torch.empty(1, dtype=torch.int64, device=dev))
    if causal:
        kw.update(
            q_pos=torch.empty(1, Q, dtype=torch.int64, device=dev),
            k_pos=torch.empty(1, N, dtype=torch.int64, device=dev),
            k_pos_sorted=True,
        )
    counted, bytes_per_key = {}, {}
    launches = _split_launches(monkeypatch, pt, run=False)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        launches.clear()
        k = torch.empty(1, H_kv, N, d, dtype=kv, device=dev)
        scales = {}
        if kv.itemsize == 1:
            s = torch.empty(1, H_kv, N, d // 32, dtype=torch.bfloat16, device=dev)
            scales = dict(k_scale=s, v_scale=s)
        pt.partial_attention_triton(q, k, k, **kw, **scales)
        counted[kv] = len(launches)
        bytes_per_key[kv] = 2 * (d * kv.itemsize + (2 * d // 32 if scales else 0))  # K and V rows, scales
    assert counted[torch.float8_e4m3fn] == counted[torch.bfloat16] == -(-Q // (pt.tile_rows(G) // G))
    ratio = (
        counted[torch.float8_e4m3fn]
        * bytes_per_key[torch.float8_e4m3fn]
        / (counted[torch.bfloat16] * bytes_per_key[torch.bfloat16])
    )
    assert ratio <= 0.55, (step, G, counted, ratio)
