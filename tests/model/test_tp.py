"""Tensor parallel x tree attention on a (cp x tp) mesh of CPU ranks: token ids equal
transformers' greedy decode, weights sharded 1/T, collectives counted, a bad --tp refused, and
two torchrun nodes on one machine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import ranks
from treeattn_cli.verify import tiny as tiny_models
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.model.load import load_tokenizer
from treeattn_cli.engine.job import EngineJob
from helpers import assert_usage_error, cli
import os
import torch
from ranks import fake_cuda_graphs

TREEATTN = str(Path(sys.executable).with_name("treeattn"))
FAMILIES = ("llama", "qwen3", "gemma2")  # GQA; q/k norms and tied embeddings; window + softcap
NEW = 8


@pytest.fixture(scope="module")
def models(tiny):
    out = {}
    for i, kind in enumerate(FAMILIES):
        over = {"tie_word_embeddings": True} if kind == "qwen3" else {}
        out[kind] = tiny(kind, seed=10 + i, **over)
    return out


def _prompt_ids(model, n):
    return [(11 * i + 7) % 240 + 10 for i in range(n)]


def _jobs(models, tp, n, chunks):
    return [
        EngineJob(
            str(models[k]),
            _prompt_ids(models[k], n),
            max_new_tokens=NEW,
            dtype="float32",
            tp=tp,
            prefill_chunk=c,
            sampling=Sampling(),
            speculate="off",
        )
        for k in FAMILIES
        for c in chunks
    ]


@pytest.mark.parametrize("world,tp", [(2, 2), (2, 1), (4, 2)], ids=["tp2-cp1", "tp1-cp2", "tp2-cp2"])
def test_mesh_tokens_equal_transformers(models, world, tp):
    """(tp, cp) in {(2, 1), (1, 2), (2, 2)} on Llama, Qwen3 (tied embeddings, q/k norms) and
    Gemma-2 (sliding window + soft-capping); a 37-token prompt (not divisible by cp), with and
    without --prefill-chunk 5."""
    n = 37
    want = {k: tiny_models.hf_greedy(models[k], _prompt_ids(models[k], n), NEW) for k in FAMILIES}
    chunks = (None, 5)
    full_bytes = {
        k: sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(models[k]).parameters()) for k in FAMILIES
    }
    res = run_local(ranks.mesh_generate, world, _jobs(models, tp, n, chunks), timeout_s=180)[0]
    i = 0
    for k in FAMILIES:
        for c in chunks:
            toks, summary = res[i]
            i += 1
            assert toks == want[k], (k, c, world, tp)
            assert summary["tp"] == tp and summary["cp"] == world // tp and summary["nodes"] == 1
            assert sum(summary["shard_tokens"]) == n + NEW - 1 and len(summary["shard_tokens"]) == world // tp
            if tp > 1:  # rank 0 holds its shards only: half the weights, plus the replicated norms
                assert summary["weight_bytes"] <= 0.55 * full_bytes[k], (k, summary["weight_bytes"])


@pytest.mark.parametrize("tp", [2])
def test_weights_are_sharded_and_collectives_counted(models, tp):
    """Every rank holds 1/T of each sharded weight (q/k/v, gate/up by output rows; o, down by
    input columns; embeddings and LM head by vocabulary) and one decode step runs, per layer,
    the two tensor-parallel all-reduces (o_proj, down_proj) and the two of the tree merge
    (MAX, SUM), then one broadcast of the sampled token."""
    res = run_local(tp_shards_and_collectives, 4, str(models["llama"]), tp, 3, timeout_s=120)
    for shards, counts, L in res:
        for name, (local, full) in shards.items():
            if len(full) == 1:  # norms: replicated
                assert local == full, name
                continue
            dim = 1 if any(s in name for s in ("o_proj", "down_proj")) else 0
            assert local[dim] * tp == full[dim] and local[1 - dim] == full[1 - dim], (name, local, full)
        assert counts == {"all_reduce": 4 * L, "broadcast": 1}, counts


@pytest.mark.parametrize("nproc,tp", [(2, 3), (3, 2), (4, 4)])
def test_bad_tp_is_refused(models, nproc, tp):
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(models["llama"]),
            "--prompt",
            "hi",
            "--no-chat",
            "--nproc",
            str(nproc),
            "--tp",
            str(tp),
        ],
    )
    assert_usage_error(r, "H = 4")
    err = r.stderr.strip().splitlines()
    assert "H_kv = 2" in err[0], err
    assert err[0].endswith(": 1, 2") or err[0].endswith(": 1"), err


def test_tp_hook_is_feature_tested_and_a_missing_one_refuses_only_tp(models, monkeypatch):
    """--tp hands transformers' loader our sub-mesh through a private function, tested for by
    feature, not by version: present here; moved or reshaped, --tp is refused in one line
    before any rank starts (exit 2), and a run without --tp is unaffected."""
    import json as _json

    import transformers.distributed.mixin as mixin

    from treeattn_cli.model import tp

    assert tp.hook_problem() is None
    monkeypatch.setattr(mixin, "initialize_distributed_mesh", lambda distributed_config, extra=None: None)
    assert "changed it" in tp.hook_problem()
    monkeypatch.delattr(mixin, "initialize_distributed_mesh")
    assert "absent" in tp.hook_problem()
    common = [
        "generate",
        "--model",
        str(models["llama"]),
        "--prompt",
        "hi",
        "--no-chat",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "2",
    ]
    assert_usage_error(cli(*common, "--nproc", "2", "--tp", "2"), "--tp needs transformers")
    r = cli(*common, "--nproc", "2", "--json")
    assert r.exit_code == 0 and _json.loads(r.stdout.splitlines()[-1])["token_ids"], r.output


def test_two_nodes_under_torchrun(models):
    """Two torchrun agents on this machine (two nodes, two ranks each, rendezvous on
    127.0.0.1) with --tp 2: tensor-parallel groups stay inside a node, the sequence shards span
    the two, the tokens are transformers', and the record says 2 nodes."""
    torchrun = Path(sys.executable).with_name("torchrun")
    tok = load_tokenizer(models["llama"])
    prompt = "a sequence shard on each node, and half of the weights on each rank"
    want = tiny_models.hf_greedy(models["llama"], tok(prompt)["input_ids"], 6)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [
        subprocess.Popen(
            [
                str(torchrun),
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                TREEATTN,
                "generate",
                "--model",
                str(models["llama"]),
                "--prompt",
                prompt,
                "--no-chat",
                "--tp",
                "2",
                "--dtype",
                "float32",
                "--max-new-tokens",
                "6",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for i in range(2)
    ]
    outs = [a.communicate(timeout=300) for a in agents]
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-2000:]
    recs = [json.loads(x) for out, _ in outs for x in out.splitlines() if x.startswith("{")]
    assert len(recs) == 1, outs  # rank 0 alone prints
    r = recs[0]
    assert r["token_ids"] == want and r["nodes"] == 2 and r["tp"] == 2 and r["cp"] == 2 and r["nproc"] == 4


def test_cross_node_cp_groups_plan_hierarchical():
    """A cp group spread over two DGX nodes merges inside each node first (NVSwitch), then
    across the two leaders (NET); on one node it stays flat."""
    from treeattn_cli.parallel.mesh import Mesh
    from treeattn_cli.topology.layout import cp_layout

    two = cp_layout(Mesh(16, 1), ["a"] * 8 + ["b"] * 8, "dgx-h100", heads=64, head_dim=128, layers=80, intra="NVSWITCH")
    assert two.scheme == "hierarchical" and two.groups == [list(range(8)), list(range(8, 16))]
    one = cp_layout(Mesh(16, 2), ["a"] * 16, "dgx-h100", heads=64, head_dim=128, layers=80, intra="NVSWITCH")
    assert one.scheme != "hierarchical" and one.groups == [list(range(8))]


def test_simulated_70b_mesh():
    """Llama-3.1-70B (141 GB of bf16 weights) cannot run on one rank per sequence shard of 8 x
    80 GB (tp = 1 does not fit); the projection marks the fastest (tp, cp) that fits."""
    from treeattn_cli.bench.projection import simulate_mesh

    recs = simulate_mesh("dgx-h100", [8, 16], [131072, 1 << 20], [1, 2, 4, 8], "llama-3.1-70b")
    assert {(r["nproc"], r["tp"]) for r in recs} == {(p, t) for p in (8, 16) for t in (1, 2, 4, 8)}
    assert not any(r["fits"] for r in recs if r["tp"] == 1)
    for p in (8, 16):
        for n in (131072, 1 << 20):
            rows = [r for r in recs if r["nproc"] == p and r["seq_len"] == n]
            best = [r for r in rows if r.get("best")]
            assert len(best) == 1 and best[0]["fits"]
            assert best[0]["step_ms_median"] == min(r["step_ms_median"] for r in rows if r["fits"])
    r = next(r for r in recs if r["nproc"] == 16 and r["tp"] == 4 and r["seq_len"] == 1 << 20)
    assert r["cp"] == 4 and r["scheme"] == "hierarchical"  # cp ranks 0-1 on node 0, 2-3 on node 1
    assert abs(r["mem_per_gpu_gb"] - (70.554e9 * 2 / 4 + 2 * 80 * 2 * 128 * (1 << 18) * 2) / 1e9) < 1e-6


def test_topo_plans_the_merge_over_cp_groups():
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    fx = Path(__file__).parents[1] / "fixtures" / "topology" / "nvswitch_8x_h100_tabs.txt"
    r = CliRunner().invoke(app, ["topo", "--from-file", str(fx), "--tp", "2", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["tp"] == 2 and rec["cp"] == 4
    assert rec["tp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rec["cp_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    r = CliRunner().invoke(app, ["topo", "--from-file", str(fx), "--tp", "3"])
    assert_usage_error(r, "--tp")


def test_loading_is_sharded(tmp_path):
    """No rank materialises the whole model: while loading its half (--tp 2), a rank's anonymous
    memory grows by less than its shard plus the runtime's own (~50 MB), never by the whole
    checkpoint (411 MB of fp32 here; measured: ~170 MB)."""
    d = tiny_models.make_model(
        "llama",
        tmp_path / "big",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
    )
    total = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    for grown, held in run_local(tp_load_memory, 2, str(d), 2, timeout_s=120):
        assert held <= 0.55 * total
        assert grown <= 0.6 * total, (grown, total)


def test_cuda_graph_capture_is_agreed_by_the_world_and_a_failed_warm_up_is_fatal(models):
    """A CUDA-graph capture that fails on one rank makes every rank of the world decode eagerly,
    tensor-parallel peers included (tp 2: each rank is its own sequence shard, so agreeing within
    the cp group alone would leave rank 0 replaying a graph while rank 1 runs eagerly). A rank
    that fails inside the warm-up step (which runs the collectives for real) stops the run with
    its own error, promptly, instead of leaving its peers in mismatched collectives."""
    from treeattn_cli.parallel.launch import LaunchError

    ids = _prompt_ids(models["llama"], 19)
    want = tiny_models.hf_greedy(models["llama"], ids, NEW)
    job = EngineJob(
        str(models["llama"]), ids, max_new_tokens=NEW, dtype="float32", tp=2, static=True, sampling=Sampling()
    )
    toks, state, note = run_local(graph_agreement, 2, job, "capture", timeout_s=60)[0]
    assert toks == want
    assert state == [[0.0, 0.0], [0.0, 0.0]], state  # no rank kept its graph
    assert "CUDA graph capture failed" in note
    # promptly: well before the collective timeout (300 s here) a rank left in a mismatched
    # collective would wait for; the bound is generous for a loaded 2-core machine
    import time

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: RuntimeError: CUDA out of memory \(simulated"):
        run_local(graph_agreement, 2, job, "warmup", timeout_s=300)
    assert time.monotonic() - t0 < 120


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def tp_shards_and_collectives(ctx, model_dir, tp, new_tokens):
    """Under (cp x tp): every linear layer holds 1/tp of its weight on this rank (the dimension
    the model's plan shards), and the collectives of one decode step of ``generate`` (the batch
    loop's step and the broadcast of the step's tokens after it), counted by kind."""
    import torch.distributed as dist

    from treeattn_cli.engine.batch import BatchDecoder
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.job import EngineJob
    from transformers import AutoModelForCausalLM

    # the checkpoint's own layers (load_model would fuse the unsharded model's projections)
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    job = EngineJob(
        model_dir, (torch.arange(20) + 30).tolist(), max_new_tokens=new_tokens, dtype="float32", tp=tp, speculate="off"
    )
    eng = Engine(ctx, job)
    shards = {}
    for name, p in eng.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ref = dict(full.named_parameters())[name]
        shards[name] = (tuple(local.shape), tuple(ref.shape))
    counts, steps = {}, []
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "send",
        "recv",
        "batch_isend_irecv",
        "reduce_scatter_tensor",
        "broadcast_object_list",
    )
    real = {n: getattr(dist, n) for n in names}
    real_step = BatchDecoder._step

    def counting(n):
        def f(*a, **k):
            counts[n] = counts.get(n, 0) + 1
            return real[n](*a, **k)

        return f

    def step(self, *a, **kw):  # from the first step to the second: exactly one step and its broadcast
        steps.append(1)
        if len(steps) == 1:
            for n in names:
                setattr(dist, n, counting(n))
        elif len(steps) == 2:
            for n in names:
                setattr(dist, n, real[n])
        return real_step(self, *a, **kw)

    BatchDecoder._step = step
    try:
        eng.serve([{"op": "generate"}, {"op": "stop"}])
    finally:
        BatchDecoder._step = real_step
        for n in names:
            setattr(dist, n, real[n])
    return shards, counts, full.config.num_hidden_layers


def tp_load_memory(ctx, model_dir, tp):
    """Peak anonymous memory this rank gains while loading its tensor-parallel shard, read as
    each parameter is registered (and sampled every few ms between; file-backed pages of the
    checkpoint do not count: they are the page cache); and the bytes of weights it holds."""
    from helpers import peak_anon_growth
    from treeattn_cli.parallel import comm as C
    from treeattn_cli.parallel.mesh import Mesh
    from treeattn_cli.engine.attention import register
    from treeattn_cli.model.load import load_model, weight_bytes

    mesh = Mesh(ctx.world, tp, ctx.rank)
    tp_mesh, _ = C.grid_mesh("cpu", mesh.cp, tp)
    model, grown = peak_anon_growth(
        lambda: load_model(model_dir, torch.float32, torch.device("cpu"), attention=register(), tp_mesh=tp_mesh),
        probes=[(torch.nn.Module, "register_parameter")],
    )
    return grown, weight_bytes(model)


def graph_agreement(ctx, job, fail):
    """CUDA-graph decode on CPU ranks with stand-ins for the CUDA graph API
    (:func:`fake_cuda_graphs`). Rank 0 returns (tokens, [per rank: graph in use, note])."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.sampling import Sampling

    eng = Engine(ctx, job)
    dec = eng.dec
    fake_cuda_graphs(dec, ctx.rank, fail)
    answers = []
    real = ctx.emit
    ctx.emit = lambda kind, payload: answers.append(payload["token_ids"]) if kind == "answer" else None
    try:
        eng.serve(
            [
                {"op": "append", "ids": list(job.prompt_ids)},
                {
                    "op": "decode",
                    "seq": 0,
                    "max_new_tokens": job.max_new_tokens,
                    "sampling": vars(Sampling()),
                    "keep": False,
                },
                {"op": "stop"},
            ]
        )
    finally:
        ctx.emit = real
    os.environ.pop("TREEATTN_KERNEL", None)
    graphs = eng.bd.graphs  # (the batch loop's: a single answer is a batch of one)
    state = eng.world.all_gather_values([graphs.held > 0, graphs.on])
    return (answers[0], state.tolist(), graphs.note) if ctx.rank == 0 else None
