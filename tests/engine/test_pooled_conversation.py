"""``chat --conversation`` over the ranks' block pool (issue 35): each question and its answer
join the document's own blocks (on each rank, the share the batch's tail holds), so the next
question continues the whole conversation; ``/reset`` gives the turns' blocks back; a turn the
pool cannot hold leaves the conversation as it was before that question."""

from __future__ import annotations

import pytest
from treeattn_cli.engine.job import EngineJob
from treeattn_cli.parallel.launch import run_local
from treeattn_cli.verify import tiny as tiny_models

DOC = [(13 * i + 5) % 230 + 20 for i in range(150)]
QUESTIONS = [[(7 * i + j) % 230 + 20 for i in range(n)] for j, n in ((1, 9), (2, 1), (3, 14))]
NEW = 7


def conversation(doc, questions, answers):
    """What transformers sees before each question: the document, every earlier question and
    its whole answer (the last token too: it is fed with the next question)."""
    ctx, out = list(doc), []
    for q, a in zip(questions, answers):
        out.append(ctx + list(q))
        ctx = ctx + list(q) + list(a)
    return out


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama", seed=6)


@pytest.mark.parametrize("world", [1, 2])
def test_kept_turns_join_the_document_and_answer_as_transformers(model, world):
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW)
    got = run_local(pooled_conversation, world, job, DOC, QUESTIONS, NEW, None, 16, timeout_s=120)[0]
    answers = [t["tokens"] for t in got["turns"]]
    for prompt, a in zip(conversation(DOC, QUESTIONS, answers), answers):
        assert a == tiny_models.hf_greedy(model, prompt, NEW)
    assert all(t["kept"] and t["consistent"] for t in got["turns"]), got
    # the document grew by each question and answer but the answer's last token (fed next time)
    sizes = [got["start"]["doc_tokens"]] + [t["doc_tokens"] for t in got["turns"]]
    want, n = [len(DOC)], len(DOC)
    for i, q in enumerate(QUESTIONS):
        n += (1 if i else 0) + len(q) + NEW - 1  # the pending token, the question, the answer less its last
        want.append(n)
    assert sizes == want, (sizes, want)
    assert got["turns"][-1]["used"] > got["start"]["used"]  # the turns took blocks of the pool
    # each turn's tokens went to the ranks holding the fewest of the document and the turns: balanced
    assert all(max(t["counts"]) - min(t["counts"]) <= 1 for t in got["turns"]), [t["counts"] for t in got["turns"]]
    assert got["own_cache_tokens"] == 0  # nothing went through the engine's own cache
    # /reset: back to the document, its turns' blocks given back; the first question answers as before
    assert got["reset"] == got["start"], got
    assert got["again"]["tokens"] == answers[0] and got["again"]["kept"], got


def test_a_turn_the_pool_cannot_hold_leaves_the_conversation_as_it_was(model):
    """A pool with one block to spare for turns (26 free slots) beside the batch's tail (the long
    question's 3 blocks): the first turn (16 tokens) fits, the long
    second one does not (its answer is given, not kept: its tail holds the blocks the turn would
    need until it is folded in), the short third one does: it continues the conversation of the
    first alone."""
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=NEW)
    qs = [QUESTIONS[0], [(5 * i + 1) % 230 + 20 for i in range(40)], QUESTIONS[1]]
    got = run_local(pooled_conversation, 1, job, DOC, qs, NEW, -(-len(DOC) // 16) + 1 + 3, 16, timeout_s=120)[0]
    first, second, third = got["turns"]
    assert first["kept"] and not second["kept"] and third["kept"], got
    assert second["doc_tokens"] == first["doc_tokens"] and second["used"] == first["used"], got
    assert second["tokens"] == tiny_models.hf_greedy(model, DOC + qs[0] + first["tokens"] + qs[1], NEW)
    assert third["tokens"] == tiny_models.hf_greedy(model, DOC + qs[0] + first["tokens"] + qs[2], NEW)
    assert third["doc_tokens"] == first["doc_tokens"] + 1 + len(qs[2]) + NEW - 1, got


def test_a_kept_question_goes_to_the_ranks_that_hold_the_fewest_of_the_document(model):
    """An answer of one token feeds nothing (its token waits for the next turn), so what joins
    the document is the question alone, placed token by token where the document and the
    question so far are shortest: 153 tokens on 2 ranks ([77, 76]) and 9 more stay balanced
    (placed as if the document held nothing, they would start on rank 0: [82, 80])."""
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=1)
    doc = DOC + [77, 78, 79]
    got = run_local(pooled_conversation, 2, job, doc, [QUESTIONS[0]], 1, None, 16, timeout_s=120)[0]
    (turn,) = got["turns"]
    assert turn["kept"] and turn["doc_tokens"] == len(doc) + len(QUESTIONS[0]), got
    assert max(turn["counts"]) - min(turn["counts"]) <= 1, turn["counts"]


def test_a_batch_keeps_at_most_one_question_per_document(model):
    job = EngineJob(str(model), [], dtype="float32", max_new_tokens=3)
    got = run_local(two_kept_questions, 1, job, DOC, timeout_s=120)[0]
    assert got["error"] and "at most one question per document" in got["error"], got
    assert got["after"] == got["before"] == len(DOC), got


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def pooled_conversation(ctx, job, doc, questions, new, pool_blocks=None, page=None):
    """``chat --conversation`` over the block pool: the document made resident (a request with
    nothing to answer), marked, then each question a batch request of one whose question and
    answer are kept (they join the document: ``documents.Documents.keep``); then back to the
    mark (``/reset``) and the first question again. Rank 0 returns each answer's tokens and
    ``kept``, the document's tokens and the pool's used blocks after each, the engine's own
    cache's tokens (nothing goes there), and the tokens the document's shard holds against its
    ids (every rank and-ed: ``consistent``)."""
    import torch

    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    spec = {"key": "conv", "ids": list(doc), "piece": -(-len(doc) // eng.mesh.cp)}
    pool = {"pool_blocks": pool_blocks} if pool_blocks else {"pool_for": len(doc), "grow": True}
    pool.update({"page": page} if page else {})
    got = []
    real, ctx.emit = ctx.emit, lambda kind, p: got.append(p[1]) if kind == "banswer" else None
    common = {"slots": 1, "sampling": {}, "stop": [], "eos_ids": [], "max_new_tokens": new, **pool}

    def ask(q):
        eng.serve([{"op": "batch", "questions": [{"ids": list(q), "doc": spec, "keep": True}], **common}])
        d = eng.documents.resident["conv"]
        consistent = (
            int(d.cache.counts[0].sum()) == len(d.ids) and int(d.cache.counts[0][eng.mesh.cp_index]) == d.cache.max_len
        )
        return {
            "tokens": got[-1]["token_ids"] if eng.lead else None,
            "kept": got[-1].get("kept") if eng.lead else None,
            "doc_tokens": len(d.ids),
            "used": eng.documents.pool.used,
            "consistent": eng.world.all_true(consistent),
            "pending": d.pending,
            "counts": d.cache.counts[0].tolist(),
        }

    try:
        eng.serve(
            [
                {"op": "batch", "questions": [{"ids": [], "doc": spec, "max_new_tokens": 0}], **common},
                {"op": "mark", "name": "doc", "doc": "conv"},
            ]
        )
        start = {"doc_tokens": len(eng.documents.resident["conv"].ids), "used": eng.documents.pool.used}
        turns = [ask(q) for q in questions]
        eng.serve([{"op": "rollback", "name": "doc", "doc": "conv"}])
        reset = {"doc_tokens": len(eng.documents.resident["conv"].ids), "used": eng.documents.pool.used}
        again = ask(questions[0])
    finally:
        ctx.emit = real
    own = len(eng.ids)
    del torch
    return (
        {
            "start": start,
            "turns": turns,
            "reset": reset,
            "again": again,
            "own_cache_tokens": own,
            "pool_blocks": eng.documents.pool.num_blocks,
        }
        if eng.lead
        else None
    )


def two_kept_questions(ctx, job, doc):
    """A batch keeping two questions over one document: refused before anything runs (the second
    would be answered without the first's turn and fed the same pending token). Rank 0 returns
    the error and the document's tokens before and after."""
    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    spec = {"key": "conv", "ids": list(doc), "piece": len(doc)}
    common = {
        "slots": 2,
        "sampling": {},
        "stop": [],
        "eos_ids": [],
        "max_new_tokens": 3,
        "pool_for": len(doc),
        "grow": True,
    }
    eng.serve([{"op": "batch", "questions": [{"ids": [], "doc": spec, "max_new_tokens": 0}], **common}])
    before = len(eng.documents.resident["conv"].ids)
    try:
        eng.serve(
            [
                {
                    "op": "batch",
                    "questions": [
                        {"ids": [21, 22], "doc": spec, "keep": True},
                        {"ids": [23], "doc": spec, "keep": True},
                    ],
                    **common,
                }
            ]
        )
        err = None
    except ValueError as e:
        err = str(e)
    return {"error": err, "before": before, "after": len(eng.documents.resident["conv"].ids)} if eng.lead else None
