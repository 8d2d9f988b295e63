"""The LSE merge of partial attention results, in fp32 (docs/architecture.md §2). Written once here.

A partial is ``(o, lse)``: ``o [..., d]`` normalised within its shard and ``lse [...]`` the
natural-log sum of exp of its scores. Partials of disjoint key sets merge exactly:

    m = max_i lse_i,  w_i = exp(lse_i - m),  o = Σ w_i o_i / Σ w_i,  lse = m + log Σ w_i

The pairwise form used by ring-flash-attention is the same thing, associative, so it can run
as a tree:  lse = lse_a - logsigmoid(lse_a - lse_b),  o = o_a - sigmoid(lse_b - lse_a)(o_a - o_b).
We evaluate the max-shifted form above instead: it needs no special case when one side is
empty (lse = -inf), and the largest weight is exactly 1 so nothing overflows. A row that is
empty everywhere gives ``o = 0, lse = -inf`` (never NaN).
"""

from __future__ import annotations

import math

import torch

NEG_INF = -math.inf


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """Replace -inf maxima (rows with no key anywhere) by 0 so that exp(lse - m) is 0, not NaN."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def merge_pair(o_a, lse_a, o_b, lse_b):
    """Merge two partials of disjoint key sets.

    Args: ``o_a, o_b [..., d]`` (any float dtype), ``lse_a, lse_b [...]``.
    Returns: ``(o [..., d] fp32, lse [...] fp32)``.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = _safe_max(torch.maximum(lse_a, lse_b))
    w_a = torch.exp(lse_a - m)  # [...], one of w_a, w_b is 1 unless both are empty
    w_b = torch.exp(lse_b - m)
    den = w_a + w_b
    o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / _nonzero(den)[..., None]
    return o, m + torch.log(den)


def merge_partials(o, lse, dim: int = 0):
    """N-way merge along ``dim`` of stacked partials.

    Args: ``o [..., S, ..., d]`` with the shard axis at ``dim`` of ``lse [..., S, ...]``
    (``dim`` counts from the left and must not be o's last axis).
    Returns: ``(o [..., d] fp32, lse [...] fp32)`` with the shard axis removed.
    """
    lse = lse.float()
    m = _safe_max(lse.amax(dim=dim, keepdim=True))  # [..., 1, ...]
    w = torch.exp(lse - m)  # [..., S, ...]
    den = w.sum(dim=dim)  # [...]
    num = (o.float() * w[..., None]).sum(dim=dim)  # [..., d]
    return num / _nonzero(den)[..., None], m.squeeze(dim) + torch.log(den)


def weigh(o, lse, m):
    """Pack a partial for a SUM all-reduce, given the global max ``m`` of the lse.

    Args: ``o [..., d]``, ``lse [...]``, ``m [...]`` (all-reduced MAX of lse).
    Returns: ``packed [..., d + 1]`` fp32 = ``[o·w, w]`` with ``w = exp(lse - m)``.
    """
    w = torch.exp(lse.float() - _safe_max(m.float()))  # [...]
    return torch.cat([o.float() * w[..., None], w[..., None]], dim=-1)


def unweigh(packed, m):
    """Finish a SUM-reduced ``[Σ o·w, Σ w]``: returns ``(o [..., d] fp32, lse [...] fp32)``."""
    num, den = packed[..., :-1], packed[..., -1]
    return num / _nonzero(den)[..., None], _safe_max(m.float()) + torch.log(den)


def _nonzero(den: torch.Tensor) -> torch.Tensor:
    """Denominator guarded for empty rows (their numerator is 0, so the result is 0)."""
    return torch.where(den > 0, den, torch.ones_like(den))
