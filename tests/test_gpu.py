"""Device tests (`pytest -m gpu` on a CUDA machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, attention_f64

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("N", [1, 129, 4096, 65536])
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_kernel_on_gpu(N, G, dtype):
    from treeattn_kernels import partial_attention

    H_kv, d = 2, 128
    q = torch.randn(2, G * H_kv, 1, d, device="cuda", dtype=dtype)
    k = torch.randn(2, H_kv, N, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    kv_len = torch.tensor([N, max(0, N - 7)], device="cuda")
    o, lse = partial_attention(q, k, v, kv_len=kv_len)
    mask = (torch.arange(N, device="cuda")[None, :] < kv_len[:, None])[:, None, :]
    o_ref, lse_ref = attention_f64(q, k, v, mask=mask)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, torch.float32 if dtype == torch.float32 else dtype, "lse")


def test_failed_capture_leaves_the_random_generator_usable():
    """A capture that fails inside ``torch.cuda.graph`` (here a host sync) leaves torch's CUDA
    generator in its capture state: every later random op raised "Offset increment outside graph
    capture encountered unexpectedly" (seen on an H100, torch 2.11: bench.gpu_decode, and sampling
    with a temperature would do the same). ``StepGraphs``' backend heals it; the next capture works."""
    from treeattn_cli.engine import graphs

    dev = torch.device("cuda")
    x = torch.randn(4, device=dev)
    with pytest.raises(Exception):
        graphs.CudaBackend().capture(lambda: (x * 2).sum().item(), dev)
    torch.randn(4, device=dev)  # raised before heal_rng
    g, out = graphs.CudaBackend().capture(lambda: x * 3, dev)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3)


def test_cuda_graph_decode_equals_eager(tmp_path):
    from treeattn_cli.verify import tiny as tiny_models
    from treeattn_cli.parallel.launch import run_local
    from treeattn_cli.engine.engine import rank_generate
    from treeattn_cli.engine.job import EngineJob

    d = tiny_models.make_model("llama", tmp_path / "m")
    ids = list(range(40, 90))
    runs = {}
    for graph in (False, True):
        toks = []
        res = run_local(
            rank_generate,
            1,
            EngineJob(
                str(d), ids, max_new_tokens=12, dtype="float32", cuda_graph=graph, speculate="off"
            ),  # drafts skip the graph
            backend="nccl",
            devices=["cuda:0"],
            on_event=lambda r, k, v: toks.append(v) if k == "token" else None,
        )
        runs[graph] = toks
        assert res[0]["cuda_graph"] == graph, res[0].get("note")
        replays = res[0]["cuda_graph_replays"]
        assert (replays >= 10) if graph else replays == 0, replays  # the graph did the steps: 11 fed tokens
    assert runs[True] == runs[False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Q,N,causal", [(300, 300, True), (300, 700, False), (513, 513, True)])
def test_long_query_blocks_on_gpu(dtype, Q, N, causal):
    """Prefill-sized query blocks go to ATen's CUDA flash kernel (its LSE must be natural-log,
    unpadded); the Triton path in query slices must agree with it and with float64."""
    from treeattn_kernels import partial_attention
    from treeattn_kernels.partial_ref import key_mask

    H_kv, G, d = 2, 4, 128
    q = torch.randn(1, G * H_kv, Q, d, device="cuda", dtype=dtype)
    k = torch.randn(1, H_kv, N, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    pos = dict(q_pos=torch.arange(Q, device="cuda"), k_pos=torch.arange(N, device="cuda")) if causal else {}
    mask = key_mask(1, Q, N, "cuda", **pos) if causal else None
    o_ref, lse_ref = attention_f64(q, k, v, mask=mask)
    for impl in ("aten", "triton"):
        o, lse = partial_attention(q, k, v, impl=impl, **pos)
        assert_close(o, o_ref, dtype, f"{impl} o")
        assert_close(lse, lse_ref, dtype, f"{impl} lse")


def test_tune_sweep_reports_resources():
    from treeattn_cli.bench.kernel import tune

    recs = tune([4096], iters=2, warmup=1, copy_bw=1e12)
    best = [r for r in recs if r.get("best")]
    assert len(best) == 1 and best[0]["regs"] > 0 and best[0]["spill_bytes"] == 0
    # timed on graph replays: eager calls would rank the host's launch time (issue 51)
    assert {r["timing"] for r in recs if "time_us" in r} == {"graph"}


def test_check_passes_on_this_gpu(tmp_path, monkeypatch):
    """`treeattn check` on the device: Triton and ATen partials, fused merges, the offline
    compile for the local target, NCCL schemes, ring decode, generate with and without the
    CUDA graph, a batch of questions with and without captured steps, all against their references."""
    import json

    from typer.testing import CliRunner

    from treeattn_cli.main import app

    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    r = CliRunner().invoke(app, ["check", "--nproc", "1", "--json", "--quiet"])
    recs = json.loads(r.stdout)
    assert r.exit_code == 0, [x for x in recs if x["verdict"] == "FAIL"]
    paths = {x["path"] for x in recs}
    assert {
        "partial/triton",
        "partial/aten",
        "merge/fused",
        "layer/fused",
        "generate/eager",
        "generate/cuda-graph",
        "batch/eager",
        "batch/cuda-graph",
    } <= paths
    assert any(p.startswith("compile/sm_") for p in paths)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache_with_diffuse_attention_keeps_its_values(dtype):
    """Issue 32: an fp8 cache's probabilities are multiplied by the values' scales before the
    PV dot; over 64K keys of near-uniform attention p ~ 2e-5 and scale ~ 2e-3 give 4e-8, below
    fp16's smallest subnormal. The kernel multiplies in bf16 for an fp16 model: the output
    matches the float64 oracle over the dequantized cache (it was flushed toward 0 before)."""
    from treeattn_kernels import dequantize
    from treeattn_kernels.partial_triton import partial_attention_triton

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 loads need sm_89 or newer")
    B, H_kv, G, N, d, S = 1, 2, 4, 65536, 128, 4
    q = (torch.randn(B, G * H_kv, 1, d, device="cuda") * 0.01).to(dtype)  # near-uniform scores
    v = 0.5 + 0.1 * torch.randn(B, H_kv, N, d, device="cuda")  # the output ~0.5: a flushed one is ~0
    k = torch.randn(B, H_kv, N, d, device="cuda")

    def fp8(x):
        xg = x.unflatten(-1, (S, -1))
        s = (xg.abs().amax(-1) / 448).to(torch.bfloat16)
        return (xg / s.float()[..., None]).flatten(-2).to(torch.float8_e4m3fn), s

    k8, ks = fp8(k)
    v8, vs = fp8(v)
    o, lse = partial_attention_triton(q, k8, v8, k_scale=ks, v_scale=vs)
    o_ref, lse_ref = attention_f64(q, dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64))
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, dtype, "lse")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_layer_operations_keep_the_logits_within_bf16_rounding(tmp_path, family):
    """Issue 51: on the GPU the norms, SiLU × up and the rotary embedding are one Triton launch
    each; a bf16 model's logits with them against transformers' own modules on the same GPU:
    within bf16's rounding (the fused kernels round where the modules round; the norm's sum runs
    in another order). A wrong fusion (gate and up swapped, a rotation turned the other way, eps
    left out) moves them by far more: the CPU tests plant those."""
    from transformers import AutoModelForCausalLM

    from treeattn_cli.model import fused
    from treeattn_cli.verify import tiny as tiny_models

    path = tiny_models.make_model(family, tmp_path / family, seed=7, num_hidden_layers=4, hidden_size=256)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    ids = torch.randint(3, 100, (2, 33), generator=torch.Generator().manual_seed(1)).cuda()
    import sys

    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    if hasattr(mod.apply_rotary_pos_emb, "treeattn_original"):  # (replaced by an earlier load in this process)
        mod.apply_rotary_pos_emb = mod.apply_rotary_pos_emb.treeattn_original
    with torch.inference_mode():
        before = model(ids).logits.float()
        done = fused.install(model)
        after = model(ids).logits.float()
    assert done["rms_norm"] > 0 and done["silu_mul"] == 4 and done["rope"] == 1, done
    scale = before.abs().max()
    assert (after - before).abs().max() <= 0.05 * scale, ((after - before).abs().max(), scale)
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.95
