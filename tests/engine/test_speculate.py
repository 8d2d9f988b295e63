"""Speculative decoding from the document: drafts by n-gram lookup, verified through the tree
merge. Tokens equal --speculate off and transformers' greedy decode on 1 and 3 ranks, tp 2 x
cp 2, with --prefill-chunk, sliding windows, soft-capping and sinks, and per slot in chat
--batch; speculative sampling keeps the model's distribution; auto backs off when drafts fail."""

from __future__ import annotations

import pytest
import torch

import ranks
from treeattn_cli.engine.sampling import Sampling
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.engine.speculate import AUTO_K, PAUSE, Drafter, Speculation, accept, parse
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models
import os
from ranks import fake_cuda_graphs

NEW = 24


def _repeats(toks) -> int:
    """Tokens of ``toks`` that repeat an earlier bigram's continuation (what n-gram drafts guess)."""
    seen, hits = {}, 0
    for i in range(2, len(toks)):
        hits += seen.get((toks[i - 2], toks[i - 1])) == toks[i]
        seen[(toks[i - 2], toks[i - 1])] = toks[i]
    return hits


@pytest.fixture(scope="module")
def copy_heavy(tmp_path_factory):
    """Tiny models and prompts whose greedy continuation repeats itself (random models fall into
    loops: the llama of seed 7 does here), so that drafts get accepted; plus windowed, soft-capped
    and sink models for exactness."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for kind, seed in (("llama", 7), ("gemma2", 4), ("gpt_oss", 5)):
        m = tiny_models.make_model(kind, root / kind, seed=seed)
        start = [(13 * i + 5) % 230 + 20 for i in range(17)]
        prompt = (start + tiny_models.hf_greedy(m, start, 40)) * 2 + start
        out[kind] = (m, prompt, tiny_models.hf_greedy(m, prompt, NEW))
    assert _repeats(out["llama"][2]) >= NEW // 2, out["llama"][2]  # the premise of the acceptance checks
    return out


@pytest.mark.parametrize("world,tp", [(1, 1), (3, 1), (4, 2)], ids=["1-rank", "3-ranks", "tp2-cp2"])
def test_speculation_equals_greedy(copy_heavy, world, tp):
    kinds = ("llama", "gemma2", "gpt_oss") if world == 3 else ("llama",)
    jobs, want = [], []
    for kind in kinds:
        m, prompt, greedy = copy_heavy[kind]
        for spec, chunk in (("off", None), ("auto", None), ("ngram:6", 7)):
            jobs.append(
                EngineJob(
                    str(m),
                    prompt,
                    max_new_tokens=NEW,
                    dtype="float32",
                    tp=tp,
                    speculate=spec,
                    prefill_chunk=chunk,
                    sampling=Sampling(),
                )
            )
            want.append((kind, spec, greedy))
    # the same jobs' drafts verified on the engine's own cache too (a single answer's path: the
    # reference the pooled answers are checked against, and the ring baseline's)
    n = len(jobs)
    jobs, want = jobs + jobs, want + want
    got = run_local(ranks.mesh_generate, world, jobs, set(range(n, 2 * n)), timeout_s=180)[0]
    for (kind, spec, greedy), (toks, summary) in zip(want, got):
        assert toks == greedy, (kind, spec)
        s = summary["speculation"]
        assert s["mode"] == spec.split(":")[0]
        # ngram:K drafts every step whatever the machine's speed (auto decides from measured step
        # times, so only its tokens are checked here; its policy has tests of its own below)
        if spec.startswith("ngram"):
            assert s["drafted"] > 0 and s["drafted"] >= s["accepted"], s
            if kind == "llama":  # the copy-heavy continuation: drafts were kept
                assert s["accepted"] > 0, s


def test_batched_slots_draft_and_accept_on_their_own(copy_heavy):
    """chat --batch with speculation: each slot drafts from the document and its own answer, and
    its tokens are those of its question alone."""
    m, prompt, _ = copy_heavy["llama"]
    doc, qs = prompt[:-17], [prompt[-17:], prompt[-17:-5], prompt[3:9], prompt[-4:]]
    want = [tiny_models.hf_greedy(m, doc + q, 12) for q in qs]
    job = EngineJob(str(m), [], dtype="float32", max_new_tokens=12)
    got, done, spec = run_local(ranks.engine_batch, 2, job, doc, qs, 3, 12, "ngram:4", timeout_s=60)[0]
    assert got == want
    # the slots drafted (from the document and their own answers) and kept some: the feature was on
    assert all(s["mode"] == "ngram" and s["drafted"] > 0 for s in spec), spec
    assert sum(s["accepted"] for s in spec) > 0, spec


def test_drafter_finds_the_latest_match_and_continues_into_the_base():
    base = Drafter([1, 2, 3, 4, 5, 1, 2, 3, 9, 9])
    d = Drafter([7, 1, 2], base=base)
    assert d.draft(3) == [3, 9, 9]  # the latest "1 2" of the document is followed by 3 9 9
    d.extend([3, 9])
    assert d.draft(2) == [9, 7]  # "3 9" in the document, then the continuation runs into these tokens
    assert Drafter([5, 6, 7]).draft(4) == [] and d.draft(0) == []


def test_drafts_do_not_depend_on_where_the_sequence_is_cut_into_base_and_own():
    """A batch's slot drafts over (document | question + answer), one question alone over
    (document + question | answer): the same sequence cut in another place. The drafts must be
    the same, n-grams across the cut included, or speculative sampling draws differently on
    the two paths (issue 32's combination test found answers that parted at the first draft)."""
    import random

    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.randint(2, 6)
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        later = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        cuts = sorted({0, len(seq), rng.randint(0, len(seq)), rng.randint(0, len(seq))})
        runs = []
        for cut in cuts:
            d = Drafter(seq[cut:], base=Drafter(seq[:cut])) if cut else Drafter(seq)
            out = []
            for t in later:
                out.append(d.draft(3))
                d.extend([t])
            out.append(d.draft(3))
            runs.append(out)
        assert all(r == runs[0] for r in runs), (trial, seq, cuts)


def test_drafter_keeps_copying_the_passage_it_follows():
    """Once the answer follows a passage, drafts continue that passage, though the last n-gram
    occurs later in the document too; a token off the passage goes back to the n-gram lookup."""
    doc = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 0, 0]  # "4 5 6" again at the end, followed by 0 0
    d = Drafter([], base=Drafter(doc))
    d.extend([1, 2])
    assert d.draft(2) == [3, 4]
    d.extend([3, 4])  # the drafts were kept
    assert d.draft(2) == [5, 6]
    d.extend([5, 6])
    assert d.draft(2) == [7, 8]  # the passage goes on; the latest "4 5 6" (index 13) would say 0 0
    d.extend([9, 3])  # off the passage
    assert d.draft(2) == [4, 5]  # the lookup: the latest "9 3" is followed by 4 5
    fresh = Drafter([], base=Drafter(doc))
    fresh.extend([1, 2, 3, 4, 5, 6])
    assert fresh.draft(2) == [0, 0]  # without a passage followed: the latest match


def test_speculative_sampling_keeps_the_distribution():
    """A draft is kept with the model's probability of it, else the model's distribution
    without it is sampled: the first emitted token is distributed as the model says, whatever
    the draft (5,000 draws each, within 4 standard errors; the generator is seeded)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None].repeat(2, 1)
    s = Sampling(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(123)
    n = 5000
    for draft in (0, 3):
        counts = torch.zeros(4)
        for _ in range(n):
            counts[accept(logits, [draft], s, gen)[0]] += 1
        err = (counts / n - probs).abs() / torch.sqrt(probs * (1 - probs) / n)
        assert (err < 4).all(), (draft, counts / n)


def test_auto_prices_drafts_and_backs_off_when_they_fail():
    """auto measures a plain step first, then drafts the number of tokens that pays best for
    the measured cost of a draft row and the share of drafts kept: many when they are kept and
    rows are cheap (a GPU), few when rows cost (a CPU), none, after a few misses, until a probe;
    a verify's fixed cost (a CPU's few-row matmuls) is told apart from its per-row cost."""
    sp = Speculation.for_answer("auto", Sampling())
    assert sp.want() == 0  # no step timed yet
    sp.observe(0, 0, 0.1)
    for _ in range(4):
        k = sp.want()
        sp.observe(k, k, 0.1)  # everything kept, verifies as cheap as a step
    assert sp.want() == AUTO_K[1]
    cpu = Speculation.for_answer("auto", Sampling())
    cpu.observe(0, 0, 0.1)
    for _ in range(4):
        k = cpu.want()
        cpu.observe(k, k // 2, 0.1 + 0.02 * k)  # half kept, each draft row adds 20 % of a step
    assert AUTO_K[0] <= cpu.want() < AUTO_K[1] // 2
    for _ in range(8):  # nothing kept any more, and draft rows cost 10 % of a step each
        k = sp.want()
        sp.observe(k, 0, 0.1 + 0.01 * k)
        if not k:
            break
    assert [sp.want() for _ in range(PAUSE - 1)] == [0] * (PAUSE - 1)  # paused ...
    assert sp.want() == AUTO_K[0]  # ... then a probe
    fixed = Speculation.for_answer("auto", Sampling())  # a verify costs 1.7 steps, then 1.5 % a row (CPU)
    fixed.observe(0, 0, 0.1)
    for _ in range(12):
        k = fixed.want()
        fixed.observe(k, k, 0.17 + 0.0015 * k)
    assert fixed.want() == AUTO_K[1]  # every draft kept: worth the fixed cost
    assert abs(fixed.cost.verify(4) - (0.17 + 0.006)) < 1e-3
    fixed.a = 0.8  # 4 of 5 kept: long drafts (the fixed cost is paid once; a per-row price would say ~3)
    assert fixed.want() >= 12
    for i in range(12):  # one draft in four kept: ~1.3 tokens for 1.7 steps does not pay
        k = fixed.want()
        fixed.observe(k, i % 2, 0.17 + 0.0015 * k)
        if not k:
            break
    assert fixed.want() == 0
    off = Speculation.for_answer("auto", Sampling(temperature=0.7))
    assert off.mode == "off" and off.record()["sampling"] == "off: sampling"
    assert Speculation.for_answer("ngram:3", Sampling(temperature=0.7)).sampling == "speculative"
    for bad in ("ngram:0", "ngram:x", "on", "ngram:65"):
        with pytest.raises(ValueError, match="--speculate"):
            parse(bad)


def test_projection_prices_speculation_from_the_acceptance():
    """bench --simulate --acceptance: a verify reads what a decode step reads, so at 128K on 8
    H100s the gain is about the expected tokens per verify ((1 - a^(k+1)) / (1 - a)), a little
    less for the larger merges; with no draft kept, a little below 1."""
    from treeattn_cli.bench.projection import simulate_mesh, speculation_gain

    for a, k in ((0.7, 8), (0.0, 8)):
        (r,) = simulate_mesh("dgx-h100", [8], [131072], [8], "llama-3.1-70b", acceptance=a, draft_k=k)
        assert 0.9 * speculation_gain(a, k) < r["spec_gain"] <= speculation_gain(a, k), r
        assert r["verify_ms"] >= r["step_ms_median"]
    assert abs(speculation_gain(0.5, 3) - 1.875) < 1e-9


def test_captured_verifies_replay_and_keep_the_greedy_tokens(copy_heavy):
    """Issue 38: a single answer's speculative steps (a batch of one on the loop) replay CUDA
    graphs too (one per number of rows), as its plain steps do (``graph_standin`` on CPU ranks
    over the GPU's kernels: each replay checked to issue what its capture recorded): the tokens
    are transformers' greedy ones, drafts were kept and rejected, and verifies were replayed, on
    2 ranks (each new token kept by one of them, written off by the other)."""
    m, prompt, greedy = copy_heavy["llama"]
    for world in (2,):
        job = EngineJob(str(m), [], max_new_tokens=NEW, dtype="float32", static=True)
        toks, spec, steps, verifies, captures, note = run_local(
            graph_speculate, world, job, prompt, [], NEW, "ngram:4", timeout_s=300
        )[0]
        assert toks == greedy, world
        assert note is None, note
        assert spec["accepted"] > 0 and spec["drafted"] > spec["accepted"], spec  # kept and rejected
        assert verifies >= 3 and captures[1] >= 1, (verifies, captures)


def test_captured_batched_verifies_keep_each_questions_tokens(copy_heavy):
    """Issue 38: a batch's verifies replay CUDA graphs too (every slot a row, rows padded to a
    power of two; ``graph_standin`` on CPU ranks): each slot drafts and accepts on its own and
    its tokens are those of its question alone."""
    m, prompt, _ = copy_heavy["llama"]
    doc, qs = prompt[:-17], [prompt[-17:], prompt[-17:-5], prompt[3:9]]
    want = [tiny_models.hf_greedy(m, doc + q, 12) for q in qs]
    job = EngineJob(str(m), [], dtype="float32", max_new_tokens=12, static=True)
    got, done, spec = run_local(ranks.engine_batch, 2, job, doc, qs, 2, 12, "ngram:4", None, True, timeout_s=300)[0]
    assert got == want
    assert sum(s["accepted"] for s in spec) > 0 and any(s["drafted"] > s["accepted"] for s in spec), spec
    d = done[0]
    assert d["graph_note"] is None and d["verify_graph_replays"] >= 3, d


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def graph_speculate(ctx, job, doc, question, new, speculate):
    """One answer with drafts under (stand-in) CUDA graphs (:func:`fake_cuda_graphs`): its plain
    steps and its verifies replayed. Rank 0 returns the tokens, the answer's speculation record,
    and how many plain steps and verifies were replayed and graphs captured (step, verify)."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.sampling import Sampling

    eng = Engine(ctx, job)
    dec = eng.dec
    fake_cuda_graphs(dec, ctx.rank)
    answers = []
    real = ctx.emit
    ctx.emit = lambda kind, payload: answers.append(payload) if kind == "answer" else None
    try:
        eng.serve(
            [
                {"op": "append", "ids": doc + question},
                {
                    "op": "decode",
                    "seq": 0,
                    "max_new_tokens": new,
                    "sampling": vars(Sampling()),
                    "keep": False,
                    "speculate": speculate,
                },
                {"op": "stop"},
            ]
        )
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    if ctx.rank != 0:
        return None
    a, bd = answers[0], eng.bd  # (the batch loop's graphs: a single answer is a batch of one)
    return (
        a["token_ids"],
        a.get("speculation"),
        bd.graphs.replays,
        bd.verify_graphs.replays,
        (bd.graphs.captures, bd.verify_graphs.captures),
        bd.graphs.note or bd.verify_graphs.note,
    )
