"""The decode kernel GPUs run, end to end on CPU: with ``TREEATTN_KERNEL=triton`` the engine picks
the Triton split kernel for every decode and verify row as it does on CUDA (interpreted here by
``TRITON_INTERPRET=1``), on two ranks merged by the tree: plain decode, a batch of questions, a
verify of n-gram drafts, an fp8 cache, and a sliding-window model. Token ids equal transformers'
greedy decode (keys and values rounded as stored for fp8); the kernel is counted, so a path that
quietly fell back to ATen fails. Kept small: the interpreter runs each program in Python."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from helpers import copying_question  # noqa: E402
from treeattn_cli.engine.job import EngineJob  # noqa: E402
from treeattn_cli.storage.kvquant import KVQuant  # noqa: E402
from treeattn_cli.engine.sampling import Sampling  # noqa: E402
from treeattn_cli.parallel.launch import run_local  # noqa: E402
from treeattn_cli.verify import tiny as tiny_models  # noqa: E402
from ranks import triton_path, engine_mixed, engine_sessions_full  # noqa: E402

NEW = 4
DOC = [(13 * i + 5) % 230 + 20 for i in range(24)]
QS = [[(29 * i + 11) % 230 + 20 for i in range(k)] for k in (1, 5)]
ONE_LAYER = {"num_hidden_layers": 1}  # every kernel call is interpreted: as few as show each path


def _session(model, kv, *, questions, speculate="off", batch=False):
    reqs = [{"op": "append", "ids": DOC}, {"op": "mark", "name": "doc"}]
    for q in questions:
        reqs += [
            {"op": "append", "ids": q},
            {
                "op": "decode",
                "seq": 0,
                "max_new_tokens": NEW,
                "sampling": vars(Sampling()),
                "keep": False,
                "speculate": speculate,
            },
            {"op": "rollback", "name": "doc"},
        ]
    if batch:
        reqs.append(
            {
                "op": "batch",
                "questions": questions,
                "slots": 2,
                "max_new_tokens": NEW,
                "sampling": vars(Sampling()),
                "speculate": speculate,
            }
        )
    job = EngineJob(str(model), [], max_new_tokens=NEW, dtype="float32", kv_dtype=kv, reserve=len(DOC) + 64)
    return job, reqs + [{"op": "stop"}], None


def test_the_triton_decode_kernel_end_to_end_equals_transformers(tiny):
    llama, gemma2 = tiny("llama", seed=3, head_dim=64, **ONE_LAYER), tiny("gemma2", seed=4, **ONE_LAYER)
    rnd = KVQuant(64, "cpu").roundtrip  # gemma2: window 6 + softcap
    copying, copying8 = copying_question(llama, DOC), copying_question(llama, DOC, kv_round=rnd)
    sessions = [  # decode (plain steps, then verifies of drafts), then the questions as a batch
        _session(llama, "auto", questions=[QS[0], copying], speculate="ngram:3", batch=True),
        _session(llama, "fp8", questions=[QS[1], copying8], speculate="ngram:3", batch=True),  # fp8 tiles
        _session(gemma2, "auto", questions=QS[1:], batch=True),  # the window's first key, searched
    ]
    per_rank = run_local(triton_sessions, 2, sessions, timeout_s=600)
    got, runs = per_rank[0][0], [r[1] for r in per_rank]
    greedy = lambda m, q, **kw: tiny_models.hf_greedy(m, DOC + q, NEW, **kw)  # noqa: E731
    want = [
        [greedy(llama, q) for q in (QS[0], copying)],
        [greedy(llama, q, kv_round=rnd) for q in (QS[1], copying8)],
        [greedy(gemma2, QS[1])],
    ]
    for i, (g, answers) in enumerate(zip(got, want)):
        assert g["answers"] == answers and g["batch"] == answers, i
    for g in got[:2]:  # verifies ran: the copying question drafted and kept, alone and in the batch
        copied = [s for s, q in zip(g["speculation"], [0, 1, 0, 1]) if q]
        assert all(s["drafted"] > 0 and s["accepted"] > 0 for s in copied), g["speculation"]
    # every rank ran the Triton kernel in every session: at least once per decode step
    assert all(n >= NEW - 1 for rank in runs for n in rank), runs


def test_documents_in_the_pool_through_the_paged_kernel_equal_transformers(tiny):
    """Questions over two documents in the block pool, one batch: on the GPU's path every
    step's document rows go through the paged Triton kernel (one launch per layer for both
    documents' rows; counted), and so does every row's tail in the pool (one more launch, read
    through each slot's block table, never gathered), and the answers are transformers' greedy
    decode; the same with an fp8 pool and a sliding-window model."""
    llama, gemma2 = tiny("llama", seed=3, head_dim=64, **ONE_LAYER), tiny("gemma2", seed=4, **ONE_LAYER)
    rnd = KVQuant(64, "cpu").roundtrip
    docs = [DOC, DOC[::-1][:20]]
    qs = [(0, QS[0]), (1, QS[1]), (0, QS[1])]
    new = 10  # the first answer still runs for several steps once the second document is in
    for model, kv, kw in ((llama, "auto", {}), (llama, "fp8", {"kv_round": rnd}), (gemma2, "auto", {})):
        job = EngineJob(str(model), [], max_new_tokens=new, dtype="float32", kv_dtype=kv)
        per_rank = run_local(triton_mixed, 2, job, docs, qs, 3, new, timeout_s=600)
        (got, done), _, _ = per_rank[0]
        assert got == [tiny_models.hf_greedy(model, docs[d] + q, new, **kw) for d, q in qs], (kv, model)
        assert done[0]["documents_per_step"] == 2
        # every rank: the tail read through its tables in every forward, never gathered; the paged
        # kernel ran twice per forward (the documents' rows, then every row's tail)
        assert all(r["gathered"] == 0 and r["tables"] >= new for _, _, r in per_rank), per_rank
        assert all(n >= 2 * r["tables"] for _, n, r in per_rank), per_rank
    # one rank: the merge of a step's two partials writes the layer's output itself (nothing to
    # merge with across ranks); one document: its rows attend as views of the step's rows
    job = EngineJob(str(llama), [], max_new_tokens=new, dtype="float32")
    for ds, asked in ((docs, qs), (docs[:1], [(0, QS[0]), (0, QS[1])])):
        (got, _), _, _ = run_local(triton_mixed, 1, job, ds, asked, 3, new, timeout_s=600)[0]
        assert got == [tiny_models.hf_greedy(llama, ds[d] + q, new) for d, q in asked], len(ds)
    # one rank, an fp8 pool, one document, under the fixed row policy a GPU runs (chunks of 8
    # here): the step's merge turns the output back from the pool's rotated basis and writes the
    # layer's output in the same launch, and every linear layer of a step takes its short chunk
    # where its producer left it (the norms, silu x up, the attention's output, the final norm for
    # the LM head), none copied into the policy's buffer; the answers hold
    job8 = EngineJob(str(llama), [], max_new_tokens=new, dtype="float32", kv_dtype="fp8")
    asked = [(0, QS[0]), (0, QS[1])]
    (got, _), steps, rows = run_local(triton_fixed_rows, 1, job8, docs[:1], asked, 3, new, timeout_s=600)[0]
    assert got == [tiny_models.hf_greedy(llama, docs[0] + q, new, kv_round=rnd) for _, q in asked]
    assert steps >= new - 1 and rows == {"in_place": steps * (4 + 1), "copied": 0}, (steps, rows)


# -- rank functions (each rank runs them under launch.run_local; the tests above check what they return)


def triton_sessions(ctx, sessions):
    """:func:`engine_sessions_full` with ``TREEATTN_KERNEL=triton``: the attention kernel GPUs
    run (Triton, interpreted here) for every decode and verify row; every rank returns how many
    times its Triton kernel ran per session, rank 0 the sessions' results too."""
    out, runs = [], []
    with triton_path("partial_attention_triton") as calls:
        for session in sessions:
            before = calls[0]
            got = engine_sessions_full(ctx, [session])
            out.append(got[0] if got else None)
            runs.append(calls[0] - before)
    return (out if ctx.rank == 0 else None), runs


def triton_mixed(ctx, job, docs, questions, slots, new):
    """:func:`engine_mixed` with ``TREEATTN_KERNEL=triton``: the documents' rows of each step, and
    each row's own tokens in the batch's pooled tail, go through the paged Triton kernel
    (interpreted here); every rank returns how many times it ran and how often the tail was read
    through its block tables and gathered into dense views (``{"tables": n, "gathered": n}``),
    rank 0 the batch's result too."""
    from treeattn_cli.engine.paged_tail import PagedTail

    reads = {"tables": 0, "gathered": 0}
    real = {}
    for name, kind in (
        ("step_tables", "tables"),
        ("rows_tables", "tables"),
        ("full_tables", "tables"),
        ("update", "gathered"),
        ("view_rows", "gathered"),
        ("full", "gathered"),
    ):
        real[name] = getattr(PagedTail, name)

        def counted(self, *a, _f=real[name], _k=kind, **kw):
            reads[_k] += 1
            return _f(self, *a, **kw)

        setattr(PagedTail, name, counted)
    try:
        with triton_path("partial_attention_triton_paged") as calls:
            got = engine_mixed(ctx, job, docs, questions, slots, new)
    finally:
        for name, f in real.items():
            setattr(PagedTail, name, f)
    return got, calls[0], reads


def triton_fixed_rows(ctx, job, docs, questions, slots, new):
    """:func:`triton_mixed` under the fixed row policy (what every GPU runs; a CPU's MKL needs
    none): returns rank 0's batch result, the decode steps run and how their linear layers got
    their short chunks (``{"in_place": n, "copied": n}``)."""
    from treeattn_cli.engine.batch import BatchDecoder
    from treeattn_cli.model import invariance

    rows, steps = {"in_place": 0, "copied": 0}, [0]
    in_step = [False]
    real = {n: getattr(invariance, n) for n in ("_check", "_verdict_file", "_in_place", "_padded")}
    checks = []
    step = BatchDecoder._step

    def stepped(self, *a, **kw):
        in_step[0] = True
        steps[0] += 1
        try:
            return step(self, *a, **kw)
        finally:
            in_step[0] = False

    def in_place(part, chunk):
        got = real["_in_place"](part, chunk)
        rows["in_place"] += in_step[0] and got is not None
        return got

    def padded(part, chunk):
        rows["copied"] += in_step[0]
        return real["_padded"](part, chunk)

    invariance._check = lambda model: bool(checks.append(1) or len(checks) > 1 and real["_check"](model))  # fixed
    invariance._verdict_file = lambda model, linears: None
    invariance._in_place, invariance._padded = in_place, padded
    BatchDecoder._step = stepped
    try:
        got = triton_mixed(ctx, job, docs, questions, slots, new)[0]
    finally:
        for n, f in real.items():
            setattr(invariance, n, f)
        BatchDecoder._step = step
        invariance._PAD["chunk"] = None
    return got, steps[0], rows
