"""The attention function Hugging Face calls per layer (decode phase)."""

from __future__ import annotations

import types

import torch

from helpers import assert_close
from treeattn_cli.engine.attention import AttentionContext, treeattn_attention
from treeattn_cli.engine.cache import ShardedKVCache
from treeattn_cli.parallel.comm import Comm
from treeattn_kernels import partial_attention_ref


def test_decode_partials_reach_the_merge_in_fp32(monkeypatch):
    """A bf16 model's decode partial is merged in fp32 without being rounded to bf16 first
    (one rounding at the end, as on one device)."""
    B, H, H_kv, d, N = 1, 4, 2, 16, 9
    cache = ShardedKVCache(1, B, H_kv, d, dtype=torch.bfloat16, capacity=16)
    k0, v0 = torch.randn(B, H_kv, N, d).bfloat16(), torch.randn(B, H_kv, N, d).bfloat16()
    cache.append_chunk(0, k0, v0, torch.arange(N))
    cache.set_counts([N])
    comm = Comm.single()
    seen = []
    real = comm.merge
    monkeypatch.setattr(comm, "merge", lambda o, lse, out=None, **kw: seen.append(o.dtype) or real(o, lse, out=out, **kw))
    q = torch.randn(B, H, 1, d).bfloat16()
    k1, v1 = torch.randn(B, H_kv, 1, d).bfloat16(), torch.randn(B, H_kv, 1, d).bfloat16()
    cache.begin_step(torch.tensor([N]))
    out, _ = treeattn_attention(types.SimpleNamespace(layer_idx=0), q, k1, v1, scaling=d ** -0.5,
                                treeattn_ctx=AttentionContext(comm, cache))
    assert seen == [torch.float32]
    o_ref, _ = partial_attention_ref(q, torch.cat([k0, k1], 2), torch.cat([v0, v1], 2), scale=d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (B, 1, H, d)
    assert_close(out.transpose(1, 2), o_ref, torch.bfloat16, "o")
