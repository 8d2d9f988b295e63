"""bench: small sweeps on CPU ranks, counters vs formulas, the α–β projection."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from treeattn_cli.topology import layout as L
from treeattn_cli.bench.decode import expected_bytes
from treeattn_cli.bench.spec import BenchSpec
from treeattn_cli.bench.projection import simulate

from helpers import assert_usage_error, cli

SHAPE = ["--heads", "8", "--kv-heads", "2", "--head-dim", "32", "--iters", "2", "--warmup", "1"]


def run(*args):
    r = cli("bench", *args)
    assert r.exit_code == 0, (r.stderr, r.exception)
    return r


def test_sweep_json_csv_png_and_formulas(tmp_path):
    out_csv, out_png = tmp_path / "b.csv", tmp_path / "b.png"
    r = run(
        "--nproc",
        "2",
        "--seq-len",
        "300,1000",
        "--scheme",
        "all",
        "--layers",
        "2",
        *SHAPE,
        "--json",
        "--csv",
        str(out_csv),
        "--plot",
        str(out_png),
    )
    recs = json.loads(r.stdout)
    need = {
        "method",
        "scheme",
        "nproc",
        "seq_len",
        "batch",
        "heads",
        "kv_heads",
        "head_dim",
        "dtype",
        "step_ms_median",
        "bytes_per_step",
        "collectives_per_step",
        "peak_mem_bytes",
    }
    assert all(need <= set(x) for x in recs)
    got = {(x["method"], x["scheme"], x["seq_len"]) for x in recs}
    for n in (300, 1000):
        assert {
            ("tree", "allreduce", n),
            ("tree", "allgather", n),
            ("tree", "tree", n),
            ("ring", "ring", n),
            ("single", "none", n),
        } <= got
    spec = BenchSpec(heads=8, kv_heads=2, head_dim=32, layers=2)
    for x in recs:
        assert x["step_ms_median"] > 0 and x["step_ms_p10"] <= x["step_ms_median"] <= x["step_ms_p90"]
        if x["method"] == "tree" and x["scheme"] in ("allreduce", "allgather"):
            assert x["bytes_per_step"] == expected_bytes("tree", x["scheme"], 2, spec, x["seq_len"])
            assert x["collectives_per_step"] == (4 if x["scheme"] == "allreduce" else 2)  # 2 layers
        if x["method"] == "ring":
            assert x["bytes_per_step"] == expected_bytes("ring", "ring", 2, spec, x["seq_len"])
            assert x["collectives_per_step"] == 2 * 3  # 1 step x (K, V, lengths) x 2 layers
        if x["method"] == "single":
            assert x["nproc"] == 1 and x["bytes_per_step"] == 0
    tree_b = {x["seq_len"]: x["bytes_per_step"] for x in recs if x["scheme"] == "allreduce"}
    ring_b = {x["seq_len"]: x["bytes_per_step"] for x in recs if x["method"] == "ring"}
    assert tree_b[300] == tree_b[1000] and ring_b[1000] > 3 * ring_b[300]  # N-free vs growing with N
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == len(recs) and rows[0]["method"] == recs[0]["method"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_has_speedup_column():
    r = run("--nproc", "2", "--seq-len", "512", *SHAPE)
    assert "ring ÷" in r.stdout and "×" in r.stdout


def test_the_one_rank_row_is_compared_with_the_widest_ring():
    """`single` runs on one rank, so no ring has its rank count: its ratio is against the ring over
    the most ranks at the same length and batch, which the cell names (issue 39 item 6)."""
    import io
    import re

    from treeattn_cli.report import print_bench

    recs = [
        {"seq_len": 1024, "batch": 1, "nproc": p, "method": m, "step_ms_median": ms}
        for p, m, ms in ((2, "tree", 1.0), (2, "ring", 3.0), (4, "tree", 0.5), (4, "ring", 2.0), (1, "single", 4.0))
    ]
    buf = io.StringIO()
    print_bench(recs, file=buf)
    rows = {tuple(c.strip() for c in line.split("│")[3:5]): line for line in buf.getvalue().splitlines() if "│" in line}
    assert re.search(r"×0\.5 \(p=4\)", rows["1", "single"]), buf.getvalue()  # ring at p=4: 2.0 ms / 4.0 ms
    assert "×3.0" in rows["2", "tree"] and "×4.0" in rows["4", "tree"] and "(p=" not in rows["4", "tree"]


def test_simulator_matches_hand_computed_alpha_beta(tmp_path):
    prof = tmp_path / "toy.yaml"
    prof.write_text(
        "name: toy\ngpus_per_node: 4\nmemory_bandwidth_gbps: 1000\nlinks:\n"
        "  NVSWITCH: {alpha_us: 2, bandwidth_gbps: 100}\n  NET: {alpha_us: 10, bandwidth_gbps: 10}\n"
    )
    spec = BenchSpec(seq_lens=[4096], batch=1, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16", layers=1)
    recs = simulate(str(prof), [4], spec)
    tree, ring = recs[0], recs[1]
    shard = 2 * 1 * 2 * 1024 * 64 * 2  # K+V bytes per GPU (N/p = 1024 tokens, bf16)
    t_attn = shard / 1000e9
    m = 4 * 8 * 65  # packed partial
    # one node of 4: allgather (3 hops) beats the binary tree (2 rounds each way) in this model
    tree_merge = 3 * (2e-6 + m / 100e9)
    assert tree["scheme"] == "allgather"
    assert L.scheme_cost_s("tree", 4, L.message_bytes(1, 8, 64), L.Link(2e-6, 1 / 100e9)) == pytest.approx(
        2 * 2 * (2e-6 + m / 100e9)
    )
    assert tree["step_ms_median"] == pytest.approx((t_attn + tree_merge) * 1e3)
    xfer = 2e-6 + shard / 100e9
    assert ring["step_ms_median"] == pytest.approx((t_attn + 3 * max(t_attn, xfer)) * 1e3)


def test_simulation_tree_pulls_ahead_of_ring_as_p_grows():
    """Weak scaling as in the paper's Fig. 3 (40K tokens per GPU): ring's step grows with p,
    tree's barely moves, so tree's lead grows; a fixed N shows tree ahead at every p."""
    ratio = {}
    for p in (8, 64, 128, 1024):
        spec = BenchSpec(seq_lens=[40960 * p], heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", layers=1)
        tree, ring = simulate("dgx-h100", [p], spec)
        assert tree["method"] == "tree" and ring["method"] == "ring" and tree["simulated"]
        ratio[p] = ring["step_ms_median"] / tree["step_ms_median"]
    assert 1 < ratio[8] < ratio[64] < ratio[128] < ratio[1024]
    spec = BenchSpec(seq_lens=[1 << 20], heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", layers=32)
    recs = simulate("dgx-h100", [8, 64, 128, 1024], spec)
    for p in (8, 64, 128, 1024):
        t = next(r for r in recs if r["nproc"] == p and r["method"] == "tree")
        g = next(r for r in recs if r["nproc"] == p and r["method"] == "ring")
        assert g["step_ms_median"] > t["step_ms_median"]
    multi = next(r for r in recs if r["nproc"] == 64 and r["method"] == "tree")
    assert multi["scheme"] == "hierarchical"  # NVSwitch inside nodes, NET across


def test_simulate_cli_json():
    r = run("--simulate", "mi300x", "--gpus", "8,16", "--seq-len", "128K", "--json")
    recs = json.loads(r.stdout)
    assert len(recs) == 4 and all(x["simulated"] for x in recs)


def test_model_mode_on_tiny_model(tmp_path):
    from treeattn_cli.verify import tiny as tiny_models

    d = tiny_models.make_model("llama", tmp_path / "m")
    r = run("--model", str(d), "--seq-len", "40", "--nproc", "2", "--new-tokens", "4", "--json")
    recs = json.loads(r.stdout)
    assert {x["method"] for x in recs} == {"tree", "ring", "single"}
    assert all(x["decode_ms_per_token"] > 0 for x in recs)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--heads", "6", "--kv-heads", "4"], "multiple"),
        (["--seq-len", "0"], "--seq-len"),
        (["--seq-len", "abc"], "--seq-len"),
        (["--methods", "tree,warp"], "--methods"),
        (["--scheme", "bogus"], "--scheme"),
        (["--nproc", "0"], "--nproc"),
        (["--layers", "0"], "--layers"),
        (["--simulate", "no-such-profile"], "profile not found"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_bench_bad_input(args, needle):
    assert_usage_error(cli("bench", *args), needle)


def test_gpu_decode_bench_skips_contexts_that_do_not_fit():
    """Llama-3.1-8B's shape: 512K tokens of bf16 KV are 64 GiB, which with 15 GiB of weights
    does not fit an 80 GB card (the script crashed there); 128K (16 GiB) does."""
    from types import SimpleNamespace

    from treeattn_cli.bench.gpu_decode import GiB, LLAMA_8B, cache_bytes, fits

    cfg = SimpleNamespace(**LLAMA_8B)
    assert cache_bytes(cfg, 524288) == 64 * GiB
    free_after_weights = int(79.1 * GiB) - int(14.96 * GiB)
    assert not fits(cache_bytes(cfg, 524288 + 29), free_after_weights)
    assert fits(cache_bytes(cfg, 131072 + 29), free_after_weights)


@pytest.mark.parametrize("tied", [False, True])
def test_gpu_decode_floor_counts_the_bytes_a_step_reads(tied):
    """The decode floor reads one row of an untied input embedding table, not all of it (at
    Llama-3.1-8B's shape 1 GiB of the 16 counted before); a tied table is read whole, once, as
    the output projection."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from treeattn_cli.bench.gpu_decode import cache_bytes, floor_ms, step_weight_bytes

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    table = 1000 * 64 * 2
    every = sum(p.numel() * p.element_size() for p in m.parameters())
    assert step_weight_bytes(m) == (every if tied else every - table + 64 * 2)
    kv = 2 * 2 * 2 * 16 * 100 * 2  # K and V, layers, KV heads, head dim, tokens, bf16
    assert cache_bytes(cfg, 100) == kv
    assert floor_ms(m, 100, 1e9) == pytest.approx((step_weight_bytes(m) + kv) / 1e9 * 1e3)


def test_gpu_decode_times_the_pooled_step_commands_run(monkeypatch):
    """``bench.gpu_decode`` times the decode step every command runs: one slot of the batch loop
    over a document in the block pool (here on a CPU, eagerly): each timed step is a cascade over
    the document's blocks and the slot's tail, every layer, and writes its token into the tail."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from treeattn_cli.bench import gpu_decode
    from treeattn_cli.engine import attention

    attention.register()
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="treeattn",
    )
    m = LlamaForCausalLM(cfg).eval()
    calls = []
    real = attention._cascade
    monkeypatch.setattr(
        attention, "_cascade", lambda ctx, *a: calls.append(ctx.tail.counts[0].tolist()) or real(ctx, *a)
    )
    ms, replayed, note = gpu_decode.ours(m, 100, 5, device="cpu")
    assert ms > 0 and not replayed and note is None
    assert len(calls) == 5 * 2 and calls[0] == [1] and calls[-1] == [5]  # the tail grew a token a step


def test_model_bench_on_a_random_model_prints_records_as_measured(capsys):
    """bench.model's GPU options on the CPU: a random-weight model of a named shape (a GPU machine
    holds no weights), a row per cache storage, JSON lines printed as measured; fp32 on the CPU
    is exactly transformers' greedy answer."""
    from treeattn_cli.bench import model as bm

    bm.main(
        [
            "--device",
            "cpu",
            "--random",
            "tiny",
            "--prompt-tokens",
            "48",
            "--nproc",
            "1",
            "--new-tokens",
            "3",
            "--kv-dtypes",
            "auto,fp8",
            "--json",
        ]
    )
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["method"], r.get("kv_dtype")) for r in recs] == [
        ("treeattn nproc=1", "float32"),
        ("treeattn nproc=1", "fp8_e4m3fn"),
        ("transformers sdpa", None),
    ]
    assert recs[0]["same_tokens_as_transformers"] is True
    assert all(r["device"] == "cpu" and r["dtype"] == "float32" and r["decode_ms_per_token"] > 0 for r in recs)
    with pytest.raises(SystemExit):
        bm.main(["--device", "tpu"])


def test_batched_decode_over_a_shared_document():
    """--shared --batch 1,8: B query rows against one document shard per rank. The merge moves
    B times the bytes of one query; the ring still moves the document once per step, whatever
    B; the projection reads the document's cache once per step for all B, so tokens/s grows
    almost linearly with B (8B, 128K keys, 8 H100s)."""
    recs = json.loads(
        run(
            "--nproc", "2", "--seq-len", "600", "--shared", "--batch", "1,8", "--scheme", "allreduce", *SHAPE, "--json"
        ).stdout
    )
    spec = BenchSpec(heads=8, kv_heads=2, head_dim=32, layers=1, shared=True)
    by = {(x["method"], x["batch"]): x for x in recs}
    assert set(by) == {(m, b) for m in ("tree", "ring", "single") for b in (1, 8)} and all(x["shared"] for x in recs)
    for b in (1, 8):
        assert by["tree", b]["bytes_per_step"] == expected_bytes("tree", "allreduce", 2, spec, 600, batch=b)
        assert by["ring", b]["bytes_per_step"] == expected_bytes("ring", "ring", 2, spec, 600, batch=b)
    assert by["tree", 8]["bytes_per_step"] == 8 * by["tree", 1]["bytes_per_step"]
    assert by["ring", 8]["bytes_per_step"] == by["ring", 1]["bytes_per_step"]  # the document, once
    sim = json.loads(
        run(
            "--simulate",
            "dgx-h100",
            "--model-shape",
            "llama-3.1-8b",
            "--gpus",
            "8",
            "--seq-len",
            "128K",
            "--tp",
            "1",
            "--batch",
            "1,8,64",
            "--shared",
            "--json",
        ).stdout
    )
    kv = {r["batch"]: r["kv_ms"] for r in sim}
    rate = {r["batch"]: r["tokens_per_s"] for r in sim}
    assert kv[1] == kv[8] == kv[64] and rate[64] > 40 * rate[1]
    alone = json.loads(
        run(
            "--simulate",
            "dgx-h100",
            "--model-shape",
            "llama-3.1-8b",
            "--gpus",
            "8",
            "--seq-len",
            "128K",
            "--tp",
            "1",
            "--batch",
            "8",
            "--json",
        ).stdout
    )
    assert alone[0]["kv_ms"] == 8 * kv[8]  # eight documents of their own: eight times the reads


def test_divergence_names_the_first_differing_token_and_transformers_margin_there():
    from treeattn_cli.bench.model import divergence

    scores = [torch.tensor([0.0, 5.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 3.0, 2.9])]
    hf = {"token_ids": [1, 2], "scores": scores}
    assert divergence([1, 2], hf) == {}
    assert divergence([1, 3], hf) == {"first_divergence": 1, "margin": 0.1, "logit_scale": 3.0}
    assert divergence([2, 2], hf)["margin"] == 4.0  # transformers preferred its token by 4: not a tie
    assert divergence([1], hf) == {"first_divergence": 1}  # ours ended early


def test_the_tiers_script_times_a_document_three_ways(tiny, capsys):
    """``bench/tiers.py`` (issue 52's measurement) on a tiny model: each document made resident by
    a prefill, from the host tier and from disk, in that order, with the same first token; one
    JSON line per length. With ``--longer``: a document half as long again over each, its first
    segments loaded from the saved copy where it has a whole one (300 tokens: one 256-token
    segment on 2 CPU ranks; 40: none), the same first token as its fresh prefill."""
    from treeattn_cli.bench import tiers

    model = str(tiny("llama", seed=3))
    assert tiers.main(["--model", model, "--tokens", "40,300", "--nproc", "2", "--longer", "0.5", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["tokens"] for r in rows] == [40, 300] and [r["longer_tokens"] for r in rows] == [60, 450]
    assert all(r["sources"] == ["prefill", "host", "disk"] and len(set(r["first"])) == 1 for r in rows), rows
    assert all(r["prefill_s"] > 0 and r["host_s"] > 0 and r["disk_s"] > 0 for r in rows)
    assert [r["loaded"] for r in rows] == [0, 1] and all(len(set(r["longer_first"])) == 1 for r in rows), rows
