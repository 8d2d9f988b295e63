"""Prefill at scale: balanced causal sharding (2p chunks, rank r holding r and 2p-1-r), pass-KV
vs pass-Q by bytes, FLOP counters; token ids equal transformers' greedy decode."""

from __future__ import annotations

import pytest

import ranks
from treeattn_cli.verify import tiny as tiny_models
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.engine.prefill import pairs, plan, shard, size
from treeattn_cli.engine.job import EngineJob


def test_balanced_shard_gives_each_rank_an_early_and_a_late_chunk():
    assert shard(100, 16, 4) == [
        [(100, 102), (114, 116)],
        [(102, 104), (112, 114)],
        [(104, 106), (110, 112)],
        [(106, 108), (108, 110)],
    ]
    assert shard(0, 10, 2, balanced=False) == [[(0, 5)], [(5, 10)]]
    for n in (1, 3, 7, 8, 37):  # shorter than 2p, not divisible by it: every token exactly once
        pieces = shard(5, n, 4)
        got = sorted(t for pc in pieces for a, b in pc for t in range(a, b))
        assert got == list(range(5, 5 + n))
        assert max(size(pc) for pc in pieces) - min(size(pc) for pc in pieces) <= 2


def test_pairs_classify_by_position():
    q = [(0, 4), (12, 16)]
    assert list(pairs(q, [(4, 8), (8, 12)])) == [(1, 0, "full"), (1, 1, "full")]  # only the late chunk sees them
    assert list(pairs(q, q)) == [(0, 0, "causal"), (1, 0, "full"), (1, 1, "causal")]
    assert list(pairs(q, [(4, 8)], window=3)) == []  # after the early chunk, out of the late one's window
    assert list(pairs(q, [(8, 12)], window=3)) == [(1, 0, "masked")]  # partly inside the window
    assert list(pairs([(12, 16)], [(0, 4)], window=3)) == []


def test_plan_moves_the_fewer_bytes():
    kw = dict(p=4, heads=32, kv_heads=8, head_dim=128, esize=2)
    assert plan(8192, 0, **kw)[0] == "pass-kv"  # a fresh prefill: KV travels
    assert plan(8192, 8192, **kw)[0] == "pass-kv"  # the second segment of a chunked prefill
    assert plan(64, 100_000, **kw)[0] == "pass-q"  # a question after a long document
    assert plan(8192, 8192, window=1024, **kw)[0] == "pass-q"
    one = dict(kw, p=1)  # one rank, chunked: its own cache is attended whole by pass-KV, so a
    assert plan(5, 5, window=6, **one)[0] == "pass-q"  # window must still mask it (Gemma-2, --tp 2)
    assert plan(5, 5, **one)[0] == "pass-kv"
    method, cost = plan(64, 100_000, **kw)
    assert cost["pass-q"] < cost["pass-kv"] / 50


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_models.make_model("llama", tmp_path_factory.mktemp("pf") / "m", seed=5)


def _ids(n):
    return [(13 * i + 5) % 240 + 10 for i in range(n)]


def test_four_ranks_both_shardings_chunked_or_not_equal_transformers(llama):
    """p = 4 (p = 1..3 are the generate tests'): prompts shorter than 2p and not divisible by it,
    with and without --prefill-chunk, balanced and contiguous; both ways of meeting a cache
    (pass-KV and pass-Q) occur and are exact."""
    cases = [(n, c, s) for n in (3, 7, 37) for c in (None, 1) for s in ("balanced", "contiguous")]
    jobs = [
        EngineJob(
            str(llama),
            _ids(n),
            max_new_tokens=6,
            dtype="float32",
            prefill_chunk=c,
            prefill_sharding=s,
            sampling=Sampling(),
            speculate="off",
        )
        for n, c, s in cases
    ]
    res = run_local(ranks.mesh_generate, 4, jobs, timeout_s=180)[0]
    want = {n: tiny_models.hf_greedy(llama, _ids(n), 6) for n in (3, 7, 37)}
    methods = set()
    for (n, c, s), (toks, summary) in zip(cases, res):
        assert toks == want[n], (n, c, s)
        assert {seg["sharding"] for seg in summary["prefill_segments"]} == ({s} if n >= 4 else {"replicated"})
        methods |= {seg["method"] for seg in summary["prefill_segments"] if seg["cached"]}
    assert methods == {"pass-kv", "pass-q"}


def test_balanced_prefill_spreads_attention_flops_evenly(llama):
    """A segment of 64·p tokens: the slowest rank's attention FLOPs within 5 % of the mean
    (contiguous: the last rank does 1.6x the mean, a pipeline)."""
    jobs = [
        EngineJob(
            str(llama),
            _ids(256),
            max_new_tokens=1,
            dtype="float32",
            prefill_sharding=s,
            sampling=Sampling(),
            speculate="off",
        )
        for s in ("balanced", "contiguous")
    ]
    res = run_local(ranks.mesh_generate, 4, jobs, timeout_s=120)[0]
    ratio = {}
    for (toks, summary), s in zip(res, ("balanced", "contiguous")):
        (seg,) = summary["prefill_segments"]
        f = seg["flops_per_rank"]
        ratio[s] = max(f) / (sum(f) / len(f))
        assert seg["tokens"] == 256 and all(b > 0 for b in seg["bytes_per_rank"][:3])
    assert ratio["balanced"] <= 1.05, ratio
    assert ratio["contiguous"] >= 1.5, ratio


def test_bench_prefill_cli_and_its_projection():
    import json

    from typer.testing import CliRunner

    from treeattn_cli.main import app

    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--prefill",
            "--seq-len",
            "512",
            "--nproc",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    recs = {x["method"]: x for x in json.loads(r.stdout)}
    assert set(recs) == {"balanced", "contiguous", "single"}
    assert recs["balanced"]["flops_max_over_mean"] <= 1.01 and recs["contiguous"]["flops_max_over_mean"] >= 1.45
    assert (
        sum(recs["balanced"]["flops_per_rank"])
        == sum(recs["contiguous"]["flops_per_rank"])
        == recs["single"]["flops_per_rank"][0]
    )  # the same causal work, cut two ways
    r = CliRunner().invoke(
        app, ["bench", "--prefill", "--simulate", "dgx-h100", "--gpus", "128", "--seq-len", "1M", "--json"]
    )
    assert r.exit_code == 0, r.output
    sim = {x["method"]: x for x in json.loads(r.stdout)}
    assert sim["balanced"]["cp"] == 16 and sim["balanced"]["tp"] == 8 and sim["balanced"]["model"] == "llama-3.1-405b"
    assert sim["balanced"]["efficiency"] > 0.9 and sim["contiguous"]["efficiency"] < 0.6
