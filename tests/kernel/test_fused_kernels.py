"""The layer's small kernels (``treeattn_kernels.fused_triton``, issue 51) against their torch
references (``fused_ref``: transformers' own operations), Triton interpreted here: within the
rounding of their dtype (the reference rounds in the same places; Triton's interpreter rounds
fp32 to bf16 by truncation where a GPU rounds to nearest even, as torch), and a row's numbers
its own in any batch (issue 49). In fp32 the rotary embedding is the reference bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from treeattn_kernels import fused_triton as ft  # noqa: E402
from treeattn_kernels import rms_norm, rms_norm_ref, rope, rope_ref, silu_mul, silu_mul_ref  # noqa: E402

# a result a few units of its dtype's last place from the reference's: the reference rounds the
# same intermediates (the normed row, silu's output), whose last bit may differ by one
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 100, 576, 2048])
def test_rms_norm_is_the_reference_and_a_row_is_its_own(dtype, n):
    g = torch.Generator().manual_seed(n)
    wide = (torch.randn(7, n + 24, generator=g) * 6).to(dtype)
    x = wide[:, :n]  # rows of a wider tensor: not contiguous
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    got = ft.rms_norm_triton(x, w, 1e-6)
    _close(got, rms_norm_ref(x, w, 1e-6), dtype)
    assert torch.equal(ft.rms_norm_triton(x[3:4], w, 1e-6)[0], got[3])  # alone as among 7
    assert torch.equal(ft.rms_norm_triton(x[None], w, 1e-6)[0], got)  # [1, T, n] as [T, n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [100, 2048])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, n):
    """The residual's add and the norm after it in one launch: the sum with the bits of torch's
    add (it is the next residual), its norm the one-launch norm's of that sum, bit for bit (a
    step may norm the same sum either way), and within rounding of the reference; a row alone as
    among 7, and the sum's rows from strided inputs."""
    from treeattn_kernels import add_rms_norm_ref

    g = torch.Generator().manual_seed(n + 1)
    x = (torch.randn(7, n + 8, generator=g) * 6).to(dtype)[:, :n]
    r = (torch.randn(7, n, generator=g) * 6).to(dtype)
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    normed, total = ft.add_rms_norm_triton(x, r, w, 1e-6)
    ref_normed, ref_total = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(total, r + x) and torch.equal(ref_total, r + x)
    assert torch.equal(normed, ft.rms_norm_triton(total, w, 1e-6))
    _close(normed, ref_normed, dtype)
    alone = ft.add_rms_norm_triton(x[3:4], r[3:4], w, 1e-6)
    assert torch.equal(alone[0][0], normed[3]) and torch.equal(alone[1][0], total[3])


def test_rms_norm_takes_eps_and_every_channel():
    """The planted mistakes a tolerance must see: eps left out (a row near zero), the weight's last
    channel dropped (a width not a power of two)."""
    n = 100
    x = torch.full((2, n), 1e-4)
    w = torch.ones(n)
    w[-1] = 3.0
    _close(ft.rms_norm_triton(x, w, 1e-2), rms_norm_ref(x, w, 1e-2), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_reference(dtype):
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(5, 1500, generator=g) * 4).to(dtype), torch.randn(5, 1500, generator=g).to(dtype)
    got = ft.silu_mul_triton(gate, up)
    _close(got, silu_mul_ref(gate, up), dtype)
    assert torch.equal(ft.silu_mul_triton(gate[2:3], up[2:3])[0], got[2])
    assert not torch.equal(ft.silu_mul_triton(up, gate), got)  # the gate is the one through silu


def test_auto_runs_the_reference_on_a_cpu_and_triton_where_asked(monkeypatch):
    x, w = torch.randn(3, 64), torch.rand(64)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(silu_mul(x, w.expand(3, -1)), silu_mul_ref(x, w.expand(3, -1)))
    calls = []
    real = ft.rms_norm_triton
    monkeypatch.setattr(ft, "rms_norm_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    rms_norm(x, w, 1e-6)
    assert calls == [1]
    with pytest.raises(ValueError, match="unknown impl"):
        rms_norm(x, w, 1e-6, impl="cuda")


def _rope_inputs(dtype, d=64, B=2, H=4, Hk=2, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * d, generator=g).to(dtype).view(B, T, H, d).transpose(1, 2)  # as the attention makes them
    k = torch.randn(B, T, Hk * d, generator=g).to(dtype).view(B, T, Hk, d).transpose(1, 2)
    angles = torch.randn(B, T, d // 2, generator=g) * 30
    emb = torch.cat([angles, angles], dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_is_the_reference_and_a_row_is_its_own(dtype, d):
    q, k, cos, sin = _rope_inputs(dtype, d)
    got = ft.rope_triton(q, k, cos, sin)
    want = rope_ref(q, k, cos, sin)
    for a, b in zip(got, want):
        if dtype == torch.float32:
            assert torch.equal(a, b)  # each product and the sum rounded as torch's launches (no FMA)
        else:
            _close(a, b, dtype)
    one = ft.rope_triton(q[1:, :, 2:3], k[1:, :, 2:3], cos[1:, 2:3], sin[1:, 2:3])  # a row alone
    assert torch.equal(one[0][0, :, 0], got[0][1, :, 2]) and torch.equal(one[1][0, :, 0], got[1][1, :, 2])


def test_rope_runs_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    """A head dim that is not a power of two (the kernel's rows are whole tiles) takes the
    reference, on the GPU's path too."""
    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    q, k, cos, sin = _rope_inputs(torch.float32, d=96)
    for a, b in zip(rope(q, k, cos, sin), rope_ref(q, k, cos, sin)):
        assert torch.equal(a, b)
