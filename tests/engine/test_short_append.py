"""Short continuations after a cached prefix: an append shorter than the number of sequence
shards leaves some shard without a token of it, yet every shard must be attended and no rank
may wait on a relay (the hang of review 2, H1). Token ids equal transformers' greedy decode of
prefix + continuation on 2, 3 and 4 sequence shards and tp 2 x cp 2, for every append of
1 .. cp - 1 tokens (the replicated route) and for the shortest appends the ring routes take
(cp and cp + 1 tokens, pass-Q and pass-KV each forced)."""

from __future__ import annotations

import json

import pytest

import ranks
from helpers import cli
from treeattn_cli.verify import tiny as tiny_models
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.engine.job import EngineJob

NEW = 5
DOC = [(13 * i + 5) % 230 + 20 for i in range(47)]  # 47 tokens: no mesh divides it evenly


@pytest.fixture(scope="module")
def models(tiny):
    return {"llama": tiny("llama", seed=3), "gemma2": tiny("gemma2", seed=4)}  # window 6 + softcap


def _cont(k: int) -> list[int]:
    return [(29 * i + 11) % 230 + 20 for i in range(k)]


def _session(model, cp: int, tp: int, route: str | None, lengths):
    reqs = [{"op": "append", "ids": DOC}, {"op": "mark", "name": "doc"}]
    for k in lengths:
        reqs += [
            {"op": "append", "ids": _cont(k)},
            {"op": "decode", "seq": 0, "max_new_tokens": NEW, "sampling": vars(Sampling()), "keep": False},
            {"op": "rollback", "name": "doc"},
        ]
    job = EngineJob(str(model), [], max_new_tokens=NEW, dtype="float32", tp=tp, reserve=len(DOC) + 64)
    return job, reqs + [{"op": "stop"}], route


@pytest.mark.parametrize("world,tp", [(2, 1), (3, 1), (4, 1), (4, 2)], ids=["cp2", "cp3", "cp4", "tp2-cp2"])
def test_short_appends_after_a_cached_prefix_are_exact(models, world, tp):
    cp = world // tp
    kinds = ["llama"] + (["gemma2"] if world == 3 else [])
    sessions, expect = [], []
    for kind in kinds:
        m = models[kind]
        short = list(range(1, cp))  # 1 .. cp - 1 tokens: some shard gets none of them
        sessions.append(_session(m, cp, tp, None, short))
        expect.append([tiny_models.hf_greedy(m, DOC + _cont(k), NEW) for k in short])
        routes = ("pass-q",) if kind == "gemma2" else ("pass-q", "pass-kv")  # windows always pass queries
        for route in routes:
            sessions.append(_session(m, cp, tp, route, (cp, cp + 1)))
            expect.append([tiny_models.hf_greedy(m, DOC + _cont(k), NEW) for k in (cp, cp + 1)])
    got = run_local(ranks.engine_sessions, world, sessions, timeout_s=60)[0]
    assert got == expect


def test_generate_load_kv_and_chat_with_one_letter_questions(models, tmp_path):
    """Through the commands: `generate --load-kv DIR --prompt x` on tp 2 x cp 2, and `chat` with
    one- and two-letter questions on 3 ranks, promptly (a collective timeout of 30 s would
    turn a hang into a failure) and exactly."""
    from treeattn_cli.model.load import load_tokenizer

    m = models["llama"]
    tok = load_tokenizer(m)
    doc = tmp_path / "doc.txt"
    doc.write_text("the archive lists seven towers, a bridge of iron, and two clocks. " * 2)
    doc_ids = tok(doc.read_text())["input_ids"]
    kv = tmp_path / "kv"
    common = ["--model", str(m), "--no-chat", "--dtype", "float32", "--timeout", "30", "--json"]
    r = cli(
        "generate", *common, "--prompt-file", str(doc), "--nproc", "3", "--save-kv", str(kv), "--max-new-tokens", "1"
    )
    assert r.exit_code == 0, r.output
    r = cli(
        "generate",
        *common,
        "--load-kv",
        str(kv),
        "--prompt",
        "x",
        "--nproc",
        "4",
        "--tp",
        "2",
        "--max-new-tokens",
        str(NEW),
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout.splitlines()[-1])
    assert rec["token_ids"] == tiny_models.hf_greedy(m, doc_ids + tok("x")["input_ids"], NEW)
    # the prompt after the loaded document is a question of the pool's batch: its tokens in the
    # tail, spread over the ranks like an answer's (no sharded prefill segment of its own)
    assert rec["prefill_method"] == "batched" and rec["prefill_segments"] == [], rec
    qs = tmp_path / "qs.txt"
    qs.write_text("a\nbc\n")
    r = cli(
        "chat", *common, "--prompt-file", str(doc), "--questions", str(qs), "--nproc", "3", "--max-new-tokens", str(NEW)
    )
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [x["token_ids"] for x in recs] == [
        tiny_models.hf_greedy(m, doc_ids + tok(q)["input_ids"], NEW) for q in ("a", "bc")
    ]


def test_a_decode_keeps_no_answer_and_a_keep_is_refused(models):
    """The engine's own tokens hold what was appended, never an answer (a conversation keeps its
    turns in a named document): after a decode they are the appended ones, and a decode asking
    ``keep`` is refused before anything runs."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.parallel.launch import RankContext

    got = []
    ctx = RankContext(
        rank=0,
        world=1,
        local_rank=0,
        backend="gloo",
        device="cpu",
        timeout_s=60.0,
        emit=lambda kind, p: got.append(p["token_ids"]) if kind == "answer" else None,
    )
    eng = Engine(ctx, EngineJob(str(models["llama"]), [], dtype="float32", speculate="off"))
    decode = {"op": "decode", "max_new_tokens": NEW, "sampling": vars(Sampling())}
    eng.serve([{"op": "append", "ids": DOC[:20]}, decode])
    assert len(got[0]) == NEW and eng.ids == DOC[:20] and int(eng.prefix.cache.counts.sum()) == 20
    eng.serve([{"op": "append", "ids": DOC[20:24]}])
    with pytest.raises(ValueError, match="keeps no answer"):
        eng.serve([{**decode, "keep": True}])
    assert eng.ids == DOC[:24] and int(eng.prefix.cache.counts.sum()) == 24
