"""One-GPU decode at Llama-3.1-8B's shape (random weights, bf16): treeattn's decode step as every
command runs it (a batch of one over a document in the block pool, its tail in the pool, static
shapes replayed from a CUDA graph: ``batch.BatchDecoder``) against the memory-bandwidth floor,
transformers' eager decode step (DynamicCache, SDPA), and a ``torch.compile``d static-cache decode
step; plus time to first token of a prompt.

Decode timing needs no real prompt: each cache is filled with N random keys/values (the step's
cost does not depend on their values). Run on an H100/H200:
``python -m treeattn_cli.bench.gpu_decode --contexts 32768,131072,524288 --ttft 131072``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)


def _model(attn, device="cuda", ready: bool = False, **shape):
    """A random-weight Llama of Llama-3.1-8B's shape (``shape``: fields of it replaced), bf16.
    ``ready``: made ready as ``load_model`` makes a model (``made_ready``: fused operations,
    concatenated projections, row-invariant linear layers; ``gpu_step``'s). This script's own
    rows compare with transformers' step on the same model, so it keeps transformers' modules."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..engine.attention import register

    register()
    with torch.device(device):
        m = LlamaForCausalLM(LlamaConfig(**{**LLAMA_8B, **shape}, attn_implementation=attn)).to(torch.bfloat16)
    m = m.eval()
    if ready:  # as every command runs it
        from ..model.load import made_ready

        made_ready(m)
    return m


GiB = 1 << 30
MARGIN = 2 * GiB  # activations, logits, split partials, allocator slack


def cache_bytes(cfg, tokens: int, esize: int = 2) -> int:
    """Bytes of a K and V cache of ``tokens`` positions for every layer of ``cfg``."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * tokens * esize


def fits(need: int, free: int) -> bool:
    """Whether ``need`` bytes (plus a working margin) fit in ``free`` bytes of device memory."""
    return need + MARGIN <= free


def _guarded(fn, need):
    """``fn()``, or why not: a context that does not fit is skipped, an OOM is a result."""
    free = torch.cuda.mem_get_info()[0]
    if not fits(need, free):
        return f"skipped: needs {need / GiB:.1f} GiB + {MARGIN / GiB:.0f} GiB, {free / GiB:.1f} GiB free"
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        return f"OutOfMemoryError: {str(e)[:80]}"
    except Exception as e:  # noqa: BLE001 - one context's failure is its row's result, not the run's end
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        torch.cuda.empty_cache()


def _time(fn, n):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[2:] if len(ts) > 4 else ts)


PAGE = 64  # tokens per block of the bench's pool (the engine's default: room.PAGE)


def pooled(model, N: int, device="cuda", dtype=torch.bfloat16, extra: int = 0, quant=None, graphs: bool = True):
    """A one-rank decoder and a document of ``N`` random tokens in a block pool with room for
    ``extra`` more (the engine's layout: ``paged_shard.PagedShard``; ``quant``: an fp8 pool's
    ``KVQuant``): ``(dec, shard)``. ``graphs``: steps replayed from CUDA graphs where they can."""
    from ..engine.attention import AttentionContext
    from ..engine.decode import Decoder
    from ..engine.paged_shard import PagedShard
    from ..engine.pool import BlockPool
    from ..parallel.comm import Comm

    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    pool = BlockPool(
        c.num_hidden_layers,
        c.num_key_value_heads,
        hd,
        page=PAGE,
        num_blocks=-(-(N + extra) // PAGE) + 4,
        dtype=dtype,
        device=device,
        quant=quant,
    )
    shard = PagedShard(pool, rank=0, world=1)
    dec = Decoder(
        model,
        AttentionContext(Comm.single()),
        vocab_size=c.vocab_size,
        device=device,
        kv_heads=c.num_key_value_heads,
        static=torch.device(device).type == "cuda",
        cuda_graph=graphs,
    )
    return dec, shard


def pooled_step(model, N: int, steps: int, device="cuda", quant=None, graphs: bool = True):
    """``(one, bd)``: ``one()`` runs one decode step of one question over a document of ``N``
    random tokens in the block pool (``BatchDecoder._step``, the forward every command's steps
    run), ``steps`` of them at most; ``bd`` its batch decoder (``bd.graphs``: its captures)."""
    from ..engine.batch import BatchDecoder, _Slot
    from ..engine.documents import Document

    dec, shard = pooled(model, N, device, next(model.parameters()).dtype, extra=steps + 8, quant=quant, graphs=graphs)
    shard.begin_fill(torch.arange(N), [N])  # N tokens, as if prefilled: random keys and values
    pool = shard.pool
    for store in pool.k + pool.v:  # (an fp8 pool: random rows cast; the step's cost is not in their values)
        store.copy_(torch.randn(store.shape, device=store.device).to(store.dtype))
    for store in pool.ks + pool.vs:
        store.fill_(0.01)
    bd = BatchDecoder(dec, slots=1, capacity=steps + 8, pool=pool)
    slot = _Slot(0, 0, None, 0.0, 0.0, doc=Document("bench", [0] * N, shard), doc_tokens=N, row=0)
    bd.tail.reset_rows([0], [shard.counts[0]])
    bd.tail.admit(0, steps + 8)
    pos = [N]

    def one():
        out = bd._step([1], [pos[0]], [True], [slot])
        pos[0] += 1
        return out

    return one, bd


def ours(model, N, steps, device="cuda"):
    """Milliseconds of treeattn's decode step at ``N`` cached tokens (median), whether it replayed
    from a CUDA graph, and the graph's note (:func:`pooled_step`)."""
    one, bd = pooled_step(model, N, steps, device)
    ms = _time(one, steps) * 1e3
    replayed = bd.graphs is not None and bd.graphs.replays > 0
    return ms, replayed, bd.graphs.note if bd.graphs is not None else bd.dec.graph_note


def hf_step(model, N, steps, compiled):
    from transformers import DynamicCache, StaticCache

    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    if compiled:
        cache = StaticCache(config=c, max_cache_len=N + steps + 8)
    else:
        cache = DynamicCache()
    k = torch.randn(1, c.num_key_value_heads, N, hd, dtype=torch.bfloat16, device="cuda")
    for layer in range(c.num_hidden_layers):
        cache.update(k, k, layer, {"cache_position": torch.arange(N, device="cuda")})
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    tok = torch.tensor([[1]], device="cuda")
    pos = [N]

    @torch.inference_mode()
    def one():
        p = torch.tensor([pos[0]], device="cuda")
        fwd(
            input_ids=tok,
            position_ids=p[None],
            cache_position=p,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        pos[0] += 1

    return _time(one, steps) * 1e3


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter, but of the input embedding table
    only the row of the step's token (an untied table: 1 GiB of Llama-3.1-8B's 16 that a step
    never touches; a tied one is read whole as the output projection)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= (emb.shape[0] - 1) * emb.shape[1] * emb.element_size()
    return total


def floor_ms(model, N, copy_bw, quant=None):
    """The memory floor of one decode step at ``N`` cached tokens: the bytes it reads (weights,
    one embedding row, every layer's K and V; ``quant``: an fp8 cache's rows and scales) at the
    device's copy bandwidth."""
    from ..engine.pool import token_bytes

    c = model.config
    if quant is None:
        kv = cache_bytes(c, N)
    else:
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = N * token_bytes(c.num_hidden_layers, c.num_key_value_heads, hd, quant.dtype, quant)
    return (step_weight_bytes(model) + kv) / copy_bw * 1e3


def main(argv=None):
    from .kernel import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ttft", type=int, default=131072, help="prompt tokens for time to first token (0: skip)")
    ap.add_argument("--skip-compiled", action="store_true")
    a = ap.parse_args(argv)
    bw = copy_bandwidth(torch.device("cuda"))
    model = _model("treeattn")
    rows = []
    for N in [int(x) for x in a.contexts.split(",")]:
        row = {"context": N, "floor_ms": floor_ms(model, N, bw), "device": torch.cuda.get_device_name()}
        need = cache_bytes(model.config, N + a.steps + 9)
        res = _guarded(lambda: ours(model, N, a.steps), need)  # 512K at 8B's shape: 64 GiB of KV
        if isinstance(res, str):
            row["treeattn_ms"] = res
        else:
            row["treeattn_ms"], row["cuda_graph"], row["note"] = res
            row["fraction_of_floor"] = row["floor_ms"] / row["treeattn_ms"]
        model.set_attn_implementation("sdpa")
        for name, compiled in (("transformers_ms", False), ("compiled_static_ms", True)):
            if compiled and a.skip_compiled:
                continue
            row[name] = _guarded(lambda: hf_step(model, N, a.steps, compiled), need)
        model.set_attn_implementation("treeattn")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.ttft:
        c = model.config
        dec, shard = pooled(model, 0, extra=a.ttft + 8)
        ids = torch.randint(0, c.vocab_size, (1, a.ttft))
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.prefill(shard, ids, piece=8192)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(
            json.dumps(
                {"ttft_prompt": a.ttft, "prefill_s": dt, "prefill_tokens_per_s": a.ttft / dt, "copy_gbps": bw / 1e9}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
