"""The small operations of a Llama-style layer around its attention, in torch: the references of
``fused_triton`` (same signatures), and what a CPU runs. Their operations and order are
transformers' (``LlamaRMSNorm.forward``; ``LlamaMLP``'s ``act_fn(gate) * up`` with SiLU;
``apply_rotary_pos_emb``; Qwen2/3's and Mistral's are the same), so a CPU's numbers are its bits
(``treeattn_cli/model/fused.py`` checks that before it replaces a module or a function)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., n]`` over its last dimension: in fp32, ``x / sqrt(mean(x²) + eps)``, rounded to
    ``x``'s dtype, times ``weight [n]`` (in the dtypes' promotion)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm_ref(residual + x), residual + x)``: a layer's residual add and the RMS norm
    after it (the sum rounded to the inputs' dtype, as transformers' add)."""
    total = residual + x
    return rms_norm_ref(total, weight, eps), total


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, each rounded to the inputs' dtype as transformers' MLP does."""
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary position embedding of ``q [B, H, T, d]`` and ``k [B, H_kv, T, d]`` by ``cos, sin
    [B, T, d]`` (the rotation of each half against the other): ``(q_embed, k_embed)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
