"""The KV cache's storage choices (``--kv-dtype``) and what a token costs in each, without torch:
the flag checks, the projections of ``bench --simulate`` and the cache itself agree on them."""

from __future__ import annotations

KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
SCALE_GROUP = 32  # fp8: channels of a token's row that share one scale (kvquant.py)
SCALE_BYTES = 2  # fp8: each scale is a bfloat16


def scale_groups(head_dim: int) -> int:
    """fp8: scales per (token, KV head) row: one per ``SCALE_GROUP`` channels (at least one)."""
    return max(1, head_dim // SCALE_GROUP) if head_dim % SCALE_GROUP == 0 else 1


def row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one token's keys (or values) of one KV head, scales included."""
    if kv_dtype.startswith("fp8"):
        return head_dim + SCALE_BYTES * scale_groups(head_dim)
    return ELEMENT_BYTES[kv_dtype] * head_dim


def token_bytes(kv_dtype: str, layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of KV one token takes over every layer and KV head (keys and values)."""
    return 2 * layers * kv_heads * row_bytes(kv_dtype, head_dim)
