"""ATen's fused flash-attention kernels as a partial attention: they also return the LSE.

CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (every float dtype) — the CPU path of
decode and prefill. CUDA: ``_scaled_dot_product_flash_attention`` (fp16/bf16) — the prefill
path for long query blocks, where the Triton split-KV kernel (built for decode) is not the tool.
Same signature and contract as :func:`partial_ref.partial_attention_ref`, which it falls back
to for what the fused kernel cannot express here (sliding windows, soft-capping, arbitrary
position masks). GQA stays native: the query heads of a KV head are folded into its rows
(``[B, H_kv, G*Q, d]`` against ``[B, H_kv, N, d]``), so K/V are never repeated; a causal block
(queries and keys at the same positions, the diagonal block of prefill) runs one call per
query head of the group with the kernel's own causal skipping. An fp8 shard reaches the fused
kernel dequantized one block of keys at a time, the partials merged by LSE: the transient copy
is a block's, never the shard's.
"""

from __future__ import annotations

import math

import torch

from . import partial_ref
from .partial_ref import _emit, _merge, add_sink, block_lse_ref, check_inputs, dequantize, partial_attention_ref

_OP_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_OP_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_LN2 = math.log(2.0)
_SMALL_RAGGED = 1 << 22  # B·H·Q·N up to which a ragged batch runs as one masked fallback call
_LSE_BASE: dict = {}  # (device type, dtype) -> factor that makes the op's LSE natural-log, or None


def _raw_op(device):
    """The fused op for ``device`` as ``f(q, k, v, causal, scale) -> (o, lse)``, or None."""
    if device.type == "cpu" and _OP_CPU is not None:
        return lambda q, k, v, causal, scale: _OP_CPU(q, k, v, 0.0, causal, scale=scale)[:2]
    if device.type == "cuda" and _OP_CUDA is not None:

        def cuda(q, k, v, causal, scale):
            res = _OP_CUDA(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1][..., : q.shape[2]]

        return cuda
    return None


def _lse_factor(op, device, dtype):
    """What turns this op's LSE into a natural log: 1, or ln 2 where it returns a base-2 LSE
    (ROCm's AOTriton flash kernel before torch 2.8, pytorch#156012); None if it matches neither
    (then the fused path is not used). Measured once per device type and dtype on a tiny
    problem against a float64 logsumexp, so no version table can be wrong."""
    key = (device.type, dtype)
    if key not in _LSE_BASE:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, 64, generator=g) for n in (4, 8, 8))
        ref = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) * 0.125, -1)  # ~ 2.1..2.5
        factor = None
        try:
            _, lse = op(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), False, 0.125)
            lse = lse.double().cpu().reshape(ref.shape)
            for f in (1.0, _LN2):
                if torch.allclose(lse * f, ref, rtol=0.0, atol=0.05):  # base 2 is off by ~1
                    factor = f
                    break
        except RuntimeError:
            pass
        _LSE_BASE[key] = factor
    return _LSE_BASE[key]


def _op(device, dtype):
    """The fused op with a natural-log LSE, or None where there is none (or it cannot be trusted)."""
    op = _raw_op(device)
    if op is None:
        return None
    factor = _lse_factor(op, device, dtype)
    if factor is None:
        return None
    if factor == 1.0:
        return op
    return lambda q, k, v, causal, scale: (lambda o, lse: (o, lse * factor))(*op(q, k, v, causal, scale))


def supports(q) -> bool:
    """Whether the fused path can run ``q``'s device and dtype."""
    if q.device.type == "cuda":
        return _OP_CUDA is not None and q.dtype in (torch.float16, torch.bfloat16)
    return _OP_CPU is not None and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _contiguous_range(pos, n):
    """Start of ``pos`` if it is ``[n]`` (or every row of ``[B, n]``) equal to start..start+n-1."""
    p = pos if pos.dim() == 1 else pos[0]
    if pos.dim() == 2 and not bool((pos == p).all()):
        return None
    start = int(p[0]) if n else 0
    if n and not torch.equal(p.cpu(), torch.arange(start, start + n)):
        return None
    return start


def _one(op, q, k, v, scale, causal):
    """q [B, H, Q, d], k/v [B, H_kv, N, d] (no ragged lengths) -> (o [B,H,Q,d], lse [B,H,Q])."""
    B, H, Q, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    if not causal:
        qf = q.reshape(B, H_kv, G * Q, d)  # (B, H_kv, G*Q, d): query heads folded into rows
        o, lse = op(qf.contiguous(), k, v, False, scale)
        return o.reshape(B, H, Q, d), lse.reshape(B, H, Q)
    qg = q.view(B, H_kv, G, Q, d)
    outs = [op(qg[:, :, g].contiguous(), k, v, True, scale) for g in range(G)]
    o = torch.stack([x[0] for x in outs], 2).reshape(B, H, Q, d)  # (B, H_kv, G, Q, d) -> (B, H, Q, d)
    lse = torch.stack([x[1] for x in outs], 2).reshape(B, H, Q)
    return o, lse


def partial_attention_aten(
    q,
    k,
    v,
    *,
    scale=None,
    q_pos=None,
    k_pos=None,
    kv_len=None,
    window=None,
    softcap=None,
    sink=None,
    k_scale=None,
    v_scale=None,
    out=None,
    lse_out=None,
    fallback=None,
    block_lse=None,
    lse_block: int = 1,
    lse_rows=None,
):
    """Fused-kernel version of :func:`partial_attention_ref` (same arguments and outputs).
    ``fallback``: what runs the cases the fused kernel cannot (default: the reference), fp8
    rows and their scales as given. The fused kernel writes no scores: ``block_lse`` is
    computed beside it for the sequences whose rows ask (:func:`partial_ref.block_lse_ref`, a
    second read of their keys). ``k_scale, v_scale``: fp8 ``k``/``v``, which the fused kernel
    takes dequantized to q's dtype one block of keys at a time (:func:`_fp8_blocks`)."""
    B, H, Q, _, _, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    if block_lse is not None:
        block_lse_ref(
            q,
            k,
            block_lse=block_lse,
            lse_block=lse_block,
            lse_rows=lse_rows,
            scale=scale,
            q_pos=q_pos,
            k_pos=k_pos,
            kv_len=kv_len,
            window=window,
            softcap=softcap,
            k_scale=k_scale,
        )
    kw = dict(
        scale=scale,
        q_pos=q_pos,
        k_pos=k_pos,
        kv_len=kv_len,
        window=window,
        softcap=softcap,
        sink=sink,
        out=out,
        lse_out=lse_out,
    )
    slow = fallback or partial_attention_ref
    fp8 = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    if not supports(q) or window is not None or softcap is not None or N == 0 or Q == 0 or B * H == 0:
        return slow(q, k, v, **kw, **fp8)
    op = _op(q.device, q.dtype)
    if op is None:
        return slow(q, k, v, **kw, **fp8)
    if fp8:
        return _fp8_blocks(q, k, v, k_scale, v_scale, kw, fallback)
    causal = False
    if q_pos is not None:
        q0, k0 = _contiguous_range(q_pos, Q), _contiguous_range(k_pos, N)
        if q0 is None or k0 is None:
            return slow(q, k, v, **kw)
        if q0 >= k0 + N - 1:
            causal = False  # every key is at or before every query
        elif q0 == k0 and Q <= N:
            # the diagonal block. Keys after the last query are invisible: drop them, so the
            # kernel sees a square block (FA2 aligns a non-square causal mask bottom-right,
            # pytorch#111007; ours is by position, i.e. top-left here)
            causal = True
            if Q < N:
                k, v = k[:, :, :Q], v[:, :, :Q]
                kv_len = None if kv_len is None else kv_len.clamp(max=Q)
                kw.update(k_pos=k_pos[..., :Q], kv_len=kv_len)
        else:
            return slow(q, k, v, **kw)
    try:
        return _fused(op, q, k, v, scale, causal, kv_len, kw, slow, out, lse_out, sink)
    except RuntimeError:  # a shape the fused kernel refuses (head dim, alignment): the fallback
        if q.device.type == "cpu":
            raise
        return slow(q, k, v, **kw)


def _fp8_blocks(q, k8, v8, k_scale, v_scale, kw, fallback):
    """The fused path over fp8 rows ``k8, v8 [B, H_kv, N, d]``: each block of
    ``partial_ref._KEY_BLOCK`` keys (the reference's: 16K) dequantized to q's dtype and attended
    on its own (fp32 partials), the partials merged by LSE (docs/architecture.md §2), the sink folded in
    once. Only one block's rows are ever dequantized (~0.1 GiB at 8 KV heads, d = 128, with
    dequantize's fp32 transient), where the whole shard's were ~1.5 GiB at 128K keys."""
    B, H, Q, d = q.shape
    N, nb = k8.shape[2], partial_ref._KEY_BLOCK
    kv_len, k_pos = kw["kv_len"], kw["k_pos"]
    o = lse = None
    for n0 in range(0, N, nb):
        n1 = min(N, n0 + nb)
        part = dict(
            kw,
            k_pos=None if k_pos is None else k_pos[..., n0:n1],
            sink=None,
            lse_out=None,
            kv_len=None if kv_len is None else (kv_len - n0).clamp(0, n1 - n0),
            out=torch.empty(B, H, Q, d, dtype=torch.float32, device=q.device),
        )
        bo, bl = partial_attention_aten(
            q,
            dequantize(k8[:, :, n0:n1], k_scale[:, :, n0:n1], q.dtype),
            dequantize(v8[:, :, n0:n1], v_scale[:, :, n0:n1], q.dtype),
            fallback=fallback,
            **part,
        )
        o, lse = (bo, bl) if o is None else _merge(o, lse, bo, bl)
    if kw["sink"] is not None:
        o, lse = add_sink(o, lse, kw["sink"])
    return _emit(o, lse, q.dtype, kw["out"], kw["lse_out"])


def _fused(op, q, k, v, scale, causal, kv_len, kw, slow, out, lse_out, sink):
    B, H, Q, d = q.shape
    N = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if kv_len is None or bool((kv_len >= N).all()):
        o, lse = _one(op, q, k, v, scale, causal)
    elif not causal and B > 1 and B * H * Q * N <= _SMALL_RAGGED:
        # many short sequences of different lengths (a batch's own tokens): one masked, batched
        # call of the fallback beats one fused call per sequence (8 sequences of 7-40 keys, 9
        # heads: 0.29 ms against 0.67 ms, median, one core of the 2-core CI machine)
        return slow(q, k, v, **kw)
    else:  # ragged batch: each sequence on its own valid prefix
        o = torch.zeros(B, H, Q, d, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, Q), -math.inf, device=q.device)
        for b in range(B):
            n = int(kv_len[b])
            if n > 0:
                if causal and n < Q:
                    return slow(q, k, v, **kw)
                o[b : b + 1], lse[b : b + 1] = _one(
                    op, q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale, causal
                )
    o, lse = o.float(), lse.float()
    if sink is not None:
        o, lse = add_sink(o, lse, sink)
    return _emit(o, lse, q.dtype, out, lse_out)
