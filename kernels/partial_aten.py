"""ATen's fused flash-attention kernels as a partial attention: they also return the LSE.

CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (every float dtype) — the CPU path of
decode and prefill. CUDA: ``_scaled_dot_product_flash_attention`` (fp16/bf16) — the prefill
path for long query blocks, where the Triton split-KV kernel (built for decode) is not the tool.
Same signature and contract as :func:`partial_ref.partial_attention_ref`, which it falls back
to for what the fused kernel cannot express here (sliding windows, soft-capping, arbitrary
position masks). GQA stays native: the query heads of a KV head are folded into its rows
(``[B, H_kv, G*Q, d]`` against ``[B, H_kv, N, d]``), so K/V are never repeated; a causal block
(queries and keys at the same positions, the diagonal block of prefill) runs one call per
query head of the group with the kernel's own causal skipping.
"""

from __future__ import annotations

import math

import torch

from .partial_ref import _emit, check_inputs, partial_attention_ref

_OP_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_OP_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


def _op(device):
    """The fused op for ``device`` as ``f(q, k, v, causal, scale) -> (o, lse)``, or None."""
    if device.type == "cpu" and _OP_CPU is not None:
        return lambda q, k, v, causal, scale: _OP_CPU(q, k, v, 0.0, causal, scale=scale)[:2]
    if device.type == "cuda" and _OP_CUDA is not None:
        def cuda(q, k, v, causal, scale):
            res = _OP_CUDA(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1][..., : q.shape[2]]
        return cuda
    return None


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


def partial_attention_aten(q, k, v, *, scale=None, q_pos=None, k_pos=None, kv_len=None,
                           window=None, softcap=None, out=None, lse_out=None, fallback=None):
    """Fused-kernel version of :func:`partial_attention_ref` (same arguments and outputs).
    ``fallback``: what runs the cases the fused kernel cannot (default: the reference)."""
    B, H, Q, _, _, N = check_inputs(q, k, v, q_pos, k_pos, kv_len)
    kw = dict(scale=scale, q_pos=q_pos, k_pos=k_pos, kv_len=kv_len, window=window,
              softcap=softcap, out=out, lse_out=lse_out)
    slow = fallback or partial_attention_ref
    op = _op(q.device)
    if op is None or not supports(q) or window is not None or softcap is not None or N == 0 \
            or Q == 0 or B * H == 0:
        return slow(q, k, v, **kw)
    causal = False
    if q_pos is not None:
        q0, k0 = _contiguous_range(q_pos, Q), _contiguous_range(k_pos, N)
        if q0 is None or k0 is None:
            return slow(q, k, v, **kw)
        if q0 >= k0 + N - 1:
            causal = False  # every key is at or before every query
        elif q0 == k0 and Q <= N:
            causal = True  # the diagonal block: top-left aligned causal mask
        else:
            return slow(q, k, v, **kw)
    try:
        return _fused(op, q, k, v, scale, causal, kv_len, kw, slow, out, lse_out)
    except RuntimeError:  # a shape the fused kernel refuses (head dim, alignment): the fallback
        if q.device.type == "cpu":
            raise
        return slow(q, k, v, **kw)


def _fused(op, q, k, v, scale, causal, kv_len, kw, slow, out, lse_out):
    B, H, Q, d = q.shape
    N = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if kv_len is None or bool((kv_len >= N).all()):
        o, lse = _one(op, q, k, v, scale, causal)
    else:  # ragged batch: each sequence on its own valid prefix
        o = torch.zeros(B, H, Q, d, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, Q), -math.inf, device=q.device)
        for b in range(B):
            n = int(kv_len[b])
            if n > 0:
                if causal and n < Q:
                    return slow(q, k, v, **kw)
                o[b:b + 1], lse[b:b + 1] = _one(op, q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale, causal)
    return _emit(o.float(), lse.float(), q.dtype, out, lse_out)
