"""Many questions about one document at once (continuous batching over the shared, sharded
document): every answer equals transformers' greedy decode of document + that question alone,
for any number of ranks, tp, batch size, sliding-window and sink models, and questions of very
different lengths; sampling, stops, Ctrl-C and --save-kv behave per question."""

from __future__ import annotations

import json
import re

import pytest

import ranks
from helpers import cli, stop_string_in
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models
from ranks import complete_document, engine_batch

NEW = 6
DOC = [(13 * i + 5) % 230 + 20 for i in range(53)]
QS = [[(29 * i + 11 + j) % 230 + 20 for i in range(n)] for j, n in enumerate([1, 7, 2, 23, 3, 1, 11])]


@pytest.fixture(scope="module")
def models(tiny):
    kinds = {"llama": 3, "gemma2": 4, "gpt_oss": 5}  # plain GQA; window + softcap; sinks + windows
    out = {k: tiny(k, seed=s) for k, s in kinds.items()}
    return out, {k: [tiny_models.hf_greedy(m, DOC + q, NEW) for q in QS] for k, m in out.items()}


@pytest.mark.parametrize("world,tp,slots", [(1, 1, 3), (3, 1, 4), (4, 2, 2)], ids=["1-rank", "3-ranks", "tp2-cp2"])
def test_batched_answers_equal_each_question_alone(models, world, tp, slots):
    """Seven questions of 1 to 23 tokens, fewer slots than questions (slots free up and take the
    next question), on one rank, three, and tp 2 x cp 2."""
    paths, want = models
    kinds = ("llama", "gemma2", "gpt_oss") if world == 3 else ("llama",)
    for kind in kinds:
        job = EngineJob(str(paths[kind]), [], dtype="float32", max_new_tokens=NEW, tp=tp)
        if kind == "gpt_oss" and tp > 1:
            continue
        got, done, _ = run_local(ranks.engine_batch, world, job, DOC, QS, slots, NEW, timeout_s=120)[0]
        assert got == want[kind], kind
        assert done[0]["answers"] == len(QS) and done[0]["new_tokens"] == NEW * len(QS)


def test_steps_no_graph_replays_merge_with_one_collective(models):
    """With the layout's scheme (``--scheme auto``: ``auto_layout``) a batch's steps, which no CUDA
    graph replays, merge with one all-gather per layer instead of the all-reduce scheme's two
    (issue 38: eager steps take the scheme of fewest launches), and every answer is still
    transformers'; an explicit scheme is kept."""
    paths, want = models
    for auto, expect in ((True, "all_gather"), (False, "all_reduce")):
        job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW, auto_layout=auto)
        got, counts = run_local(engine_batch_merges, 2, job, DOC, QS, 3, NEW, timeout_s=120)[0]
        assert got == want["llama"], auto
        other = "all_reduce" if expect == "all_gather" else "all_gather"
        layers = 2  # the tiny models' (every step: one merge per layer)
        assert counts[expect] >= layers * NEW and counts[other] <= counts[expect] // 4, (auto, counts)


@pytest.mark.parametrize("world", [1, 2])
def test_long_questions_go_in_chunks_between_the_steps_of_other_answers(models, world):
    """A budget of 4 question tokens per round (``piece``): the 7-, 11- and 23-token questions
    are prefilled a chunk per round while the answers of the others decode, and every answer
    still equals transformers' on document + question alone."""
    paths, want = models
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    got, done, _ = run_local(ranks.engine_batch, world, job, DOC, QS, 3, NEW, "off", {"piece": 4}, timeout_s=120)[0]
    assert got == want["llama"]
    chunks = sum(-(-len(q) // 4) for q in QS)  # each cut from its start: 1 + 2 + 1 + 6 + 1 + 1 + 3
    assert done[0]["question_chunks"] == chunks and done[0]["chunks_while_decoding"] >= 6, done[0]


def test_ctrl_c_ends_the_batch_and_keeps_the_answers_so_far(models):
    """An interrupt after five streamed tokens: the answers under way end there (each a prefix of
    its full answer, stop reason interrupted), the questions not begun are not asked."""
    paths, want = models
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    got, done = run_local(engine_batch_interrupted, 2, job, DOC, QS, 3, NEW, 5, timeout_s=60)[0]
    assert set(got) == {0, 1, 2} and done[0]["answers"] == 3
    for qi, (toks, reason) in got.items():
        assert reason == "interrupted" and toks and toks == want["llama"][qi][: len(toks)]


def test_chat_batch_equals_one_at_a_time(models, tmp_path):
    """Through `treeattn chat`: --batch 3 and --batch 1 print the same records in question order
    (greedy, and sampling with each question's own seed stream), a stop string ends one answer
    only, and --save-kv saves the document alone. With --batch the document lives in the ranks'
    block pool (issue 35): prefilled there, saved from there, and loaded there from --load-kv."""
    paths, _ = models
    doc = tmp_path / "doc.txt"
    doc.write_text("a ledger of seven bridges and the tolls each one asks, kept since the flood. " * 3)
    qs = tmp_path / "qs.txt"
    qs.write_text("x\nwhich bridge asks the most?\nab\nand why was the ledger kept at all, after the flood?\n")
    common = [
        "--model",
        str(paths["llama"]),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--nproc",
        "2",
        "--json",
    ]

    def recs(*extra):
        r = cli("chat", *common, *extra)
        assert r.exit_code == 0, r.output
        got = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        slots = next((int(v) for k, v in zip(extra, extra[1:]) if k == "--batch"), 1)
        if slots > 1:  # the batch was on: every answer prefilled in a batch, S at a time
            assert all(x["prefill_method"] == "batched" for x in got) and f"{slots} at a time" in r.stderr, r.stderr
            assert re.search(r"\[KV pool: [1-9]\d* of \d+ blocks per rank", r.stderr), r.stderr  # the document's
        return got, r.stderr

    (one, _), (many, said) = recs("--batch", "1"), recs("--batch", "3", "--save-kv", str(tmp_path / "kv"))
    doc_tokens = many[0]["context_tokens"] - many[0]["prompt_tokens"]
    assert f"[document: {doc_tokens:,} tokens prefilled" in said and f"[saved {doc_tokens:,} cached tokens to" in said
    assert [r["question"] for r in many] == [r["question"] for r in one] and len(one) == 4
    assert [r["token_ids"] for r in many] == [r["token_ids"] for r in one]
    m = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert m["tokens"]["count"] == many[0]["context_tokens"] - many[0]["prompt_tokens"]  # the document only
    r = cli(
        "chat",
        *[x for x in common if x not in ("--prompt-file", str(doc))],
        "--load-kv",
        str(tmp_path / "kv"),
        "--batch",
        "3",
    )
    assert r.exit_code == 0 and "[loaded " in r.stderr and "[KV pool: " in r.stderr, r.output
    assert [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if x.startswith("{")] == [
        x["token_ids"] for x in one
    ]
    from treeattn_cli.model.load import load_tokenizer

    # a stop string from the second answer ends it early (and any other that says it)
    stop, n = stop_string_in(one[1]["text"], one[1]["token_ids"], load_tokenizer(paths["llama"]).decode)
    assert n < 8, (stop, n)
    (a, _), (b, _) = recs("--batch", "1", "--stop", stop), recs("--batch", "3", "--stop", stop)
    assert [(r["token_ids"], r["stop_reason"]) for r in a] == [(r["token_ids"], r["stop_reason"]) for r in b]
    assert b[1]["stop_reason"] == "stop" and b[1]["token_ids"] == one[1]["token_ids"][:n]
    assert stop in b[1]["text"] and stop in a[1]["text"]  # the command line keeps it, as generate does
    sampled = ("--temperature", "0.9", "--seed", "11")
    (a, _), (b, _) = recs("--batch", "1", *sampled), recs("--batch", "4", *sampled)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


def test_idle_slots_step_at_a_live_position(models):
    """Issue 32: a slot with no question left still has a row in each batched step (computed,
    dropped). It steps at a live position, never 0: a sliding-window layer's search starts from
    the tile's earliest query, and a row at 0 would make it read the whole shard. Three
    questions in two slots leave one slot idle for the last answer; answers stay exact."""
    paths, want = models
    job = EngineJob(str(paths["gemma2"]), [], dtype="float32", max_new_tokens=NEW)
    qs = QS[:3]
    got, steps = run_local(engine_batch_step_positions, 2, job, DOC, qs, 2, NEW, timeout_s=60)[0]
    assert got == want["gemma2"][:3]
    assert steps and all(n == 2 for _, n in steps)
    assert min(lo for lo, _ in steps) >= len(DOC), steps


def _max_logprob_gap(a: dict, b: dict) -> float:
    """The largest difference between two records' logprobs of the same top alternatives."""
    return max(abs(p[1] - q[1]) for x, y in zip(a["logprobs"], b["logprobs"]) for p, q in zip(x["top"], y["top"]))


def test_chat_batch_with_drafts_refilling_slots_equals_one_at_a_time(tmp_path):
    """Issue 32, through `treeattn chat`: --batch 3 --speculate ngram:4 over seven questions
    (slots refill while other slots' drafts are being verified and partly rejected) gives each
    question the answer it gets alone, token for token and logprob for logprob (to fp32
    round-off). Before the fix a slot that took a question wiped the owners of another slot's
    rejected drafts, which then stayed in that slot's cache: on this model the third answer's
    logprobs moved by 1e-2 while its tokens happened to survive. The drafts are checked to have
    been both accepted and rejected."""
    model = tiny_models.make_model("llama", tmp_path / "m", seed=6)
    doc = tmp_path / "doc.txt"
    doc.write_text("the east dome held the reflector; the west dome held the refractor. " * 4)
    qs = tmp_path / "qs.txt"
    qs.write_text(
        "the east dome held\nwest\nthe reflector; the west\nx\nheld the refractor. the east\ndome\n"
        "the west dome held the\n"
    )
    common = [
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "20",
        "--nproc",
        "2",
        "--json",
        "--logprobs",
        "2",
    ]

    def recs(*extra):
        r = cli("chat", *common, *extra)
        assert r.exit_code == 0, r.output
        return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]

    one, many = recs("--batch", "1", "--speculate", "off"), recs("--batch", "3", "--speculate", "ngram:4")
    assert len(one) == len(many) == 7
    assert [r["token_ids"] for r in many] == [r["token_ids"] for r in one]
    gaps = [_max_logprob_gap(a, b) for a, b in zip(one, many)]
    assert max(gaps) < 1e-4, gaps
    spec = [r["speculation"] for r in many]
    assert sum(s["accepted"] for s in spec) > 0 and any(s["drafted"] > s["accepted"] for s in spec), spec


def test_questions_over_several_documents_share_steps_and_equal_transformers(models):
    """One batch, questions over three documents (one shorter than the others), fewer slots than
    questions, each document prefilled by the batch eight tokens per rank per segment: every
    answer is transformers' greedy decode of its document and question, rows of several
    documents shared steps, and documents were prefilled while other answers decoded."""
    paths, _ = models
    docs = [DOC, DOC[::-1][:41], [(7 * i + 3) % 200 + 30 for i in range(60)]]
    qs = [(0, QS[0]), (1, QS[1]), (2, QS[2]), (1, QS[3]), (0, QS[4])]
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    got, done = run_local(ranks.engine_mixed, 2, job, docs, qs, 3, NEW, timeout_s=120)[0]
    assert got == [tiny_models.hf_greedy(paths["llama"], docs[d] + q, NEW) for d, q in qs]
    assert done[0]["documents_per_step"] >= 2 and done[0]["segments_while_decoding"] >= 1, done


@pytest.mark.parametrize("world", [1, 3])
def test_a_document_prefilled_a_segment_at_a_time_holds_the_same_numbers(models, world):
    """documents.Documents prefills a document one segment per call (a batch decodes between
    them) into the rank's block pool: what it holds equals, bit for bit, one prefill call with
    the same segments into a plain cache."""
    paths, _ = models
    job = EngineJob(str(paths["gemma2"]), [], dtype="float32", max_new_tokens=NEW)
    same, segs, kind = run_local(document_by_segments, world, job, DOC, 5, timeout_s=120)[0]
    assert same and segs > 1 and kind == "PagedShard"


def test_a_document_the_pool_can_never_hold_ends_its_questions_alone(models):
    """A pool of 4 blocks of 16 tokens per rank, a document needing 10: once the answers over
    the document that fits have ended and nothing can make room, the questions over the big one
    end empty ("no_room"), the batch does not fail, and the other answers are transformers'."""
    paths, _ = models
    big = [(11 * i + 7) % 230 + 20 for i in range(300)]
    docs = [DOC[:40], big]
    qs = [(0, QS[0]), (1, QS[1]), (0, QS[2])]
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    got, done, reasons = run_local(
        ranks.engine_mixed, 2, job, docs, qs, 2, NEW, {"pool_blocks": 4, "page": 16}, timeout_s=120
    )[0]
    assert reasons == ["length", "no_room", "length"] and got[1] == [], (reasons, got)
    assert [got[0], got[2]] == [tiny_models.hf_greedy(paths["llama"], docs[d] + q, NEW) for d, q in (qs[0], qs[2])]


def test_captured_batched_steps_replay_what_they_captured_and_answer_as_alone(models):
    """Issue 38: a batch's plain steps replayed from CUDA graphs (``graph_standin`` on CPU ranks,
    the GPU's kernels interpreted: a replay that would issue other operations, buffers or sizes
    than its capture recorded fails) answer as each question alone. Over one dense document,
    slots freeing and taking the next question: every step replayed from one graph. Over two
    pooled documents, read through their block tables: one graph per shape of the step (how many
    rows each document has), whatever documents they are: the graph of two rows over the first
    document replays for two rows over the second. The engine keeps its batch decoder: the same
    batch asked again (a server's next burst) replays the first batch's graph, captures nothing,
    and answers the same."""
    paths, want = models
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW, static=True)
    got, done, _ = run_local(ranks.engine_batch, 2, job, DOC, QS[:4], 2, NEW, "off", None, True, 2, timeout_s=300)[0]
    assert got == want["llama"][:4]
    d = done[0]
    assert d["graph_note"] is None and d["graph_captures"] == 1, d
    assert d["graph_replays"] == 2 * (NEW - 1), d  # every step: two rounds of two answers, NEW - 1 steps each
    again = done[1]  # the second batch: the decoder, its tail and its graph kept
    assert again["batch_runs"] == 2 and again["graph_captures"] == 0 and again["graph_replays"] == 2 * (NEW - 1), again
    docs = [DOC[:24], DOC[::-1][:17]]
    qs = [(0, QS[0]), (1, QS[1]), (1, QS[2])]  # slot 1 waits for the second document; then mixed steps;
    got, done = run_local(
        ranks.engine_mixed,
        2,
        job,
        docs,
        qs,
        2,
        NEW,
        None,
        True,  # then two rows of it
        timeout_s=300,
    )[0]
    assert got == [tiny_models.hf_greedy(paths["llama"], docs[d] + q, NEW) for d, q in qs]
    d = done[0]
    assert d["documents_per_step"] == 2, d  # rows of both documents shared steps
    assert d["graph_note"] is None and d["graph_captures"] == 2 and d["graph_replays"] >= 2 * (NEW - 1), d


def test_every_document_lives_in_the_pool_short_ones_and_saved_ones_that_wait(models, tmp_path):
    """Documents shorter than the three sequence shards (one and two tokens) take blocks of the
    pool like any other and are answered as transformers answers; a saved document asked for
    while an unused one fills the pool waits for blocks (that one leaves), is loaded into the
    pool (not beside it, as it once was), and answered as before."""
    paths, _ = models
    short = [[17], DOC[:50], [40, 41]]
    sq = [(0, QS[0]), (1, QS[1]), (2, QS[2]), (0, QS[3])]
    saved, big = (
        DOC[:60],
        [(7 * i + 3) % 200 + 30 for i in range(300)],
    )  # 20 and 100 tokens a rank: 2 + 7 + a tail > 8 blocks
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    outs = run_local(documents_all_pooled, 3, job, short, sq, saved, big, QS[4], NEW, tmp_path, timeout_s=180)
    lead = outs[0]
    assert lead["short"] == [tiny_models.hf_greedy(paths["llama"], short[d] + q, NEW) for d, q in sq]
    assert all(o["kinds"] == {"s0": "PagedShard", "s1": "PagedShard", "s2": "PagedShard"} for o in outs), outs
    assert lead["short_counts"]["s0"] == [1, 0, 0] and lead["short_counts"]["s2"] == [1, 1, 0], lead
    want = tiny_models.hf_greedy(paths["llama"], saved + QS[4], NEW)
    assert lead["answers"] == [want, tiny_models.hf_greedy(paths["llama"], big + QS[4], NEW), want], lead
    assert lead["sources"] == ["prefill", "prefill", "disk"], lead
    assert all(o["saved_kind"] == "PagedShard" for o in outs) and not lead["big_resident"], lead


def test_questions_wait_for_their_tails_blocks_and_give_them_back(models):
    """The batch's tail lives in the block pool: with room for the document (two blocks of 16 a
    rank) and one question's tail, three questions over two slots answer one after another, each
    as transformers answers it, the later ones waiting for the earlier one's blocks; a question
    whose tail the pool can never hold ends ``no_room`` (the others go on); at the end the pool
    holds the document alone."""
    paths, _ = models
    long_q = [(3 * i + 2) % 230 + 20 for i in range(60)]  # 33 tokens a rank with its answer: 3 blocks
    qs = [(0, QS[1]), (0, QS[2]), (0, long_q), (0, QS[4])]
    job = EngineJob(str(paths["llama"]), [], dtype="float32", max_new_tokens=NEW)
    got, done, reasons = run_local(
        ranks.engine_mixed, 2, job, [DOC], qs, 2, NEW, {"pool_blocks": 3, "page": 16}, timeout_s=120
    )[0]
    want = [tiny_models.hf_greedy(paths["llama"], DOC + q, NEW) for _, q in qs]
    assert got[:2] + got[3:] == want[:2] + want[3:] and got[2] == [], got
    assert reasons == ["length", "length", "no_room", "length"], reasons
    assert done[0]["tail_waits"] >= 1 and done[0]["pool"]["used"] == 2, done[0]


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def engine_batch_interrupted(ctx, job, doc, questions, slots, new, after):
    """The batch op, interrupted (as Ctrl-C does, through the store) once rank 0 has streamed
    ``after`` tokens: rank 0 returns {question: (token ids, stop reason)} of the answers that
    ended, and the batch_done event."""
    from treeattn_cli.engine.sampling import Sampling
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.parallel import comm as C

    got, done, seen = {}, [], [0]

    def emit(kind, p):
        if kind == "btoken":
            seen[0] += 1
            if seen[0] == after:
                C.post_interrupt(C._state["store"], 7)
        elif kind == "banswer":
            got[p[0]] = (p[1]["token_ids"], p[1]["stop_reason"])
        elif kind == "batch_done":
            done.append(p)

    real, ctx.emit = ctx.emit, emit
    try:
        Engine(ctx, job).serve(
            [
                {"op": "append", "ids": doc},
                {
                    "op": "batch",
                    "seq": 7,
                    "questions": questions,
                    "slots": slots,
                    "max_new_tokens": new,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "interruptible": True,
                },
                {"op": "stop"},
            ]
        )
    finally:
        ctx.emit = real
    return (got, done) if ctx.rank == 0 else None


def engine_batch_step_positions(ctx, job, doc, questions, slots, new):
    """:func:`engine_batch`, recording the query positions of every one-token-per-slot step of
    the batch; rank 0 returns (answers, [per step: lowest position, how many slots])."""
    from treeattn_cli.engine import attention as A

    seen = []
    real = A._cascade

    def spy(actx, layer, q, *a, **kw):
        if actx.step and layer == 0:
            seen.append((int(actx.positions.min()), int(actx.positions.numel())))
        return real(actx, layer, q, *a, **kw)

    A._cascade = spy
    try:
        got = engine_batch(ctx, job, doc, questions, slots, new)
    finally:
        A._cascade = real
    return (got[0], seen) if ctx.rank == 0 else None


def document_by_segments(ctx, job, doc, piece):
    """A document made resident a segment at a time (``documents.Documents``: in the block
    pool) and the same tokens prefilled in one call with the same ``piece`` into a plain cache:
    rank 0 returns whether every rank's keys, values and positions are bitwise equal, how many
    segments the first took, and its kind."""
    import torch

    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    d = eng.documents.get({"key": "k", "ids": doc, "piece": piece})
    segs = len(d.todo)
    complete_document(eng.documents, d)
    other = eng.documents.new_shard()
    eng.dec.prefill(other, torch.tensor([doc]), piece)
    same = (
        d.cache.max_len == other.max_len
        and torch.equal(d.cache.counts, other.counts)
        and all(
            torch.equal(x, y)
            for layer in range(other.num_layers)
            for x, y in zip(d.cache.view(layer), other.view(layer))
        )
    )  # k, v, length, positions
    every = eng.world.all_gather_values([int(same)])
    return (bool(every.min()), segs, type(d.cache).__name__) if ctx.rank == 0 else None


def engine_batch_merges(ctx, job, doc, questions, slots, new):
    """:func:`engine_batch`, counting every rank's collectives during the batch: rank 0 returns
    its answers and ``{"all_gather": n, "all_reduce": n}`` of the batch's steps."""
    from treeattn_cli.parallel.comm import Comm

    counts = {"all_gather": 0, "all_reduce": 0}
    real = {name: getattr(Comm, name) for name in counts}

    def counted(name):
        def call(self, *a, **kw):
            counts[name] += 1
            return real[name](self, *a, **kw)

        return call

    for name in counts:
        setattr(Comm, name, counted(name))
    try:
        got = engine_batch(ctx, job, doc, questions, slots, new)
    finally:
        for name, fn in real.items():
            setattr(Comm, name, fn)
    return (got[0], counts) if ctx.rank == 0 else None


def documents_all_pooled(ctx, job, short_docs, short_qs, saved, big, q, new, root):
    """Every document lives in the rank's block pool (issue 35, item 2). One batch of
    ``short_qs`` over ``short_docs`` (some shorter than the sequence shards); then, in a pool of
    8 blocks of 16 tokens, ``saved`` is answered and written through to ``root``, ``big`` takes
    the pool (``saved`` leaves), and ``q`` over ``saved`` again finds no free blocks: its saved
    copy waits for them (``big`` leaves) and is loaded into the pool. Every rank returns the
    kind of each short document's cache; rank 0 also the answers and what became of ``saved``."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.storage.kvstore import model_identity

    got, sources = {}, {}

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]] = p[1]["token_ids"]
        elif kind == "bdoc":
            sources[p[0]] = p[1]["source"]

    base = ranks.greedy_batch(new)  # (slots: each call's own)
    real, ctx.emit = ctx.emit, emit
    out = {}
    try:
        eng = Engine(ctx, job)
        pool = {
            "pool_blocks": 8,
            "page": 16,
            "host_memory": 0,
        }  # (the first document makes the pool; no host tier: from disk)
        eng.serve(
            [
                {
                    **base,
                    **pool,
                    "slots": 2,
                    "questions": [{"ids": qq, "doc": {"key": f"s{d}", "ids": short_docs[d]}} for d, qq in short_qs],
                }
            ]
        )
        out["short"] = [got.get(i) for i in range(len(short_qs))]
        out["kinds"] = {k: type(d.cache).__name__ for k, d in eng.documents.resident.items()}
        out["short_counts"] = {k: d.cache.counts[0].tolist() for k, d in eng.documents.resident.items()}
        for k in list(eng.documents.resident):
            eng.documents._evict(k)
        disk = {
            "dir": str(root),
            "save": True,
            **pool,
            "save_meta": {"identity": model_identity(job.model_dir), "composition": {}},
        }
        for name, ids in (("saved", saved), ("big", big), ("saved", saved)):
            got.clear()
            sources.clear()
            eng.serve([{**base, **disk, "slots": 1, "questions": [{"ids": q, "doc": {"key": name, "ids": ids}}]}])
            out.setdefault("answers", []).append(got.get(0))
            out.setdefault("sources", []).append(sources.get(0))
        d = eng.documents.resident.get("saved")
        out["saved_kind"] = type(d.cache).__name__ if d is not None else None
        out["big_resident"] = "big" in eng.documents.resident
        eng.serve([{"op": "stop"}])
    finally:
        ctx.emit = real
    return out if ctx.rank == 0 else {"kinds": out.get("kinds"), "saved_kind": out.get("saved_kind")}
