"""The attention function Hugging Face calls per layer (a step's cascade)."""

from __future__ import annotations

import types

import torch

from helpers import assert_close, begin_step
from treeattn_cli.engine.attention import AttentionContext, treeattn_attention
from treeattn_cli.engine.paged_shard import PagedShard
from treeattn_cli.engine.paged_tail import PagedTail
from treeattn_cli.engine.pool import BlockPool
from treeattn_cli.parallel.comm import Comm
from treeattn_kernels import partial_attention_ref


def test_step_partials_reach_the_merge_in_fp32(monkeypatch):
    """A bf16 model's step partial (its document's and its tail's, merged) is merged across ranks
    in fp32 without being rounded to bf16 first (one rounding at the end, as on one device)."""
    H, H_kv, d, N = 4, 2, 16, 9
    pool = BlockPool(1, H_kv, d, page=8, num_blocks=8, dtype=torch.bfloat16)
    doc = PagedShard(pool, rank=0, world=1)
    k0, v0 = torch.randn(1, H_kv, N, d).bfloat16(), torch.randn(1, H_kv, N, d).bfloat16()
    doc.append_chunk(0, k0, v0, torch.arange(N))
    doc.set_counts([N])
    tail = PagedTail(pool, 1, rank=0, world=1)
    tail.admit(0, 8)
    tail.reset_rows([0], [doc.counts[0]])
    comm = Comm.single()
    seen = []
    real = comm.merge
    monkeypatch.setattr(
        comm, "merge", lambda o, lse, out=None, **kw: seen.append(o.dtype) or real(o, lse, out=out, **kw)
    )
    q = torch.randn(1, H, 1, d).bfloat16()
    k1, v1 = torch.randn(1, H_kv, 1, d).bfloat16(), torch.randn(1, H_kv, 1, d).bfloat16()
    begin_step(tail, torch.tensor([N]))
    ctx = AttentionContext(
        comm, phase="cascade", tail=tail, rows=[0], step=True, groups=[(doc, None, [0])], positions=torch.tensor([[N]])
    )
    out, _ = treeattn_attention(types.SimpleNamespace(layer_idx=0), q, k1, v1, scaling=d**-0.5, treeattn_ctx=ctx)
    tail.end_step()
    assert seen == [torch.float32]
    o_ref, _ = partial_attention_ref(q, torch.cat([k0, k1], 2), torch.cat([v0, v1], 2), scale=d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, H, d)
    assert_close(out.transpose(1, 2), o_ref, torch.bfloat16, "o")
    assert tail.host_length.tolist() == [1]  # the step's token is in the tail
