"""Rank functions several test files run (each rank under ``launch.run_local``, importable by the
ranks): each runs on every rank with the same seed, builds the same full inputs, keeps its own
shard, and returns numbers for the parent test to check against the one-rank oracle. A rank
function one test file runs lives in that file."""

from __future__ import annotations

import contextlib
import os


class Recorded:
    """What rank 0's engine said while ``recording(ctx)`` ran: each question's answer
    (``answers``: index -> token ids), how its document became resident (``sources``: index ->
    memory, pool, host, disk, prefill; ``reused``: its tokens that did not need a prefill here),
    the documents' reports (``reports``: each ``docs``
    payload: evicted, saved, corrupt, made, host), and its stderr (``stderr``, at the end)."""

    def __init__(self):
        self.answers, self.sources, self.reused, self.reports, self.stderr = {}, {}, {}, [], ""

    def clear(self) -> None:
        self.answers.clear()
        self.sources.clear()
        self.reused.clear()

    def emit(self, kind, p) -> None:
        if kind == "banswer":
            self.answers[p[0]] = p[1]["token_ids"]
        elif kind == "bdoc":
            self.sources[p[0]] = p[1]["source"]
            self.reused[p[0]] = p[1].get("reused")
        elif kind == "docs":
            self.reports.append(p)


def greedy_batch(new: int, slots: int = 1, **extra) -> dict:
    """A batch request's fields for greedy answers of ``new`` tokens in ``slots`` slots, 8-token
    prefill pieces, no drafts, no stop strings; ``extra``: the rest (pool, page, dir, ...)."""
    from treeattn_cli.engine.sampling import Sampling

    return {
        "op": "batch",
        "max_new_tokens": new,
        "piece": 8,
        "sampling": vars(Sampling()),
        "stop": [],
        "eos_ids": [],
        "speculate": "off",
        "slots": slots,
        **extra,
    }


@contextlib.contextmanager
def recording(ctx):
    """Rank 0's engine events (and this rank's stderr) into a :class:`Recorded` while the block runs."""
    import io
    import sys

    rec, real, err = Recorded(), ctx.emit, sys.stderr
    ctx.emit, sys.stderr = rec.emit, io.StringIO()
    try:
        yield rec
    finally:
        rec.stderr = sys.stderr.getvalue()
        ctx.emit, sys.stderr = real, err


def mesh_generate(ctx, jobs, single=()):
    """``engine.rank_generate`` for each job in turn on these ranks (several (cp x tp) meshes in
    one launch; the jobs whose index is in ``single`` on the engine's own cache, a single
    answer's path); rank 0 returns, per job, (token ids, summary)."""
    from treeattn_cli.engine.engine import rank_generate

    out = []
    for i, job in enumerate(jobs):
        toks = []
        real = ctx.emit
        ctx.emit = lambda kind, payload: toks.append(payload) if kind == "token" else None
        try:
            summary = rank_generate(ctx, job, single=i in single)
        finally:
            ctx.emit = real
        out.append((toks, summary))
    return out if ctx.rank == 0 else None


def engine_sessions(ctx, sessions):
    """For each ``(job, requests, route)``: an engine on these ranks serving ``requests``
    (``route``: force "pass-q" or "pass-kv" for appends after a cache); rank 0 returns, per
    session, the token ids of each decode request."""
    from treeattn_cli.engine.engine import Engine

    out = []
    for job, requests, route in sessions:
        answers = []
        real = ctx.emit
        ctx.emit = lambda kind, payload: answers.append(payload["token_ids"]) if kind == "answer" else None
        try:
            eng = Engine(ctx, job)
            eng.dec.route = route
            eng.serve(requests)
        finally:
            ctx.emit = real
        out.append(answers)
    return out if ctx.rank == 0 else None


def engine_sessions_full(ctx, sessions):
    """Like :func:`engine_sessions`; rank 0 returns per session ``{"answers": [decode answers'
    token ids], "batch": [batch answers' token ids, in question order], "records": [events of
    kind saved/loaded/done], "speculation": [each answer's speculation record: the decode
    answers', then the batch's in question order]}``."""
    from treeattn_cli.engine.engine import Engine

    out = []
    for job, requests, route in sessions:
        got = {"answers": [], "batch": {}, "records": [], "speculation": []}
        bspec = {}

        def emit(kind, payload, got=got, bspec=bspec):
            if kind == "answer":
                got["answers"].append(payload["token_ids"])
                got["speculation"].append(payload.get("speculation"))
            elif kind == "banswer":
                got["batch"][payload[0]] = payload[1]["token_ids"]
                bspec[payload[0]] = payload[1].get("speculation")
            elif kind in ("saved", "loaded"):
                got["records"].append((kind, payload))

        real = ctx.emit
        ctx.emit = emit
        try:
            eng = Engine(ctx, job)
            eng.dec.route = route
            summary = eng.serve(requests)
        finally:
            ctx.emit = real
        got["batch"] = [got["batch"][i] for i in sorted(got["batch"])]
        got["speculation"] += [bspec[i] for i in sorted(bspec)]
        got["summary"] = summary
        out.append(got)
    return out if ctx.rank == 0 else None


def fake_cuda_graphs(dec, rank: int, fail: str | None = None):
    """CUDA graphs on CPU ranks: ``graph_standin``'s backend (a replay runs the step again and
    fails if it would differ from what its capture recorded), the decoder set to use them as on
    a GPU. ``fail``: as ``graph_standin.StandIn``'s. Returns the stand-in."""
    import graph_standin

    os.environ["TREEATTN_KERNEL"] = "triton"  # the kernels a GPU captures (a CPU's read lengths on the host)
    dec.use_graph, dec.actx.eager = True, False
    return graph_standin.install(rank, fail)


def engine_batch(ctx, job, doc, questions, slots, new, speculate="off", extra=None, graphs=False, repeat=1):
    """An engine: append ``doc``, then answer ``questions`` ``slots`` at a time (the batch op,
    with ``extra`` fields; ``repeat`` times, the same batch again: the answers returned are the
    last batch's); rank 0 returns the token ids per question (question order), the batch_done
    events, and each answer's speculation record (question order: drafted, accepted).
    ``graphs``: the steps captured and replayed as on a GPU (:func:`fake_cuda_graphs`; a string:
    its ``fail``)."""
    from treeattn_cli.engine.sampling import Sampling
    from treeattn_cli.engine.engine import Engine

    got, done, spec = {}, [], {}

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]], spec[p[0]] = p[1]["token_ids"], p[1].get("speculation")
        elif kind == "batch_done":
            done.append(p)

    real, ctx.emit = ctx.emit, emit
    try:
        eng = Engine(ctx, job)
        if graphs:
            fake_cuda_graphs(eng.dec, ctx.rank, graphs if isinstance(graphs, str) else None)
        eng.serve(
            [{"op": "append", "ids": doc}]
            + [
                {
                    "op": "batch",
                    "questions": questions,
                    "slots": slots,
                    "max_new_tokens": new,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "speculate": speculate,
                    **(extra or {}),
                }
            ]
            * repeat
            + [{"op": "stop"}]
        )
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    n = len(questions)
    return ([got.get(i) for i in range(n)], done, [spec.get(i) for i in range(n)]) if ctx.rank == 0 else None


@contextlib.contextmanager
def triton_path(kernel: str):
    """``TREEATTN_KERNEL=triton`` for the block, with ``partial_triton.<kernel>`` counted: yields
    a one-item list holding the number of calls so far."""
    import treeattn_kernels.partial_triton as PT

    calls = [0]
    real = getattr(PT, kernel)

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    os.environ["TREEATTN_KERNEL"] = "triton"
    setattr(PT, kernel, counted)
    try:
        yield calls
    finally:
        os.environ.pop("TREEATTN_KERNEL", None)
        setattr(PT, kernel, real)


def complete_document(documents, doc) -> None:
    """Every remaining segment of ``doc`` now (the engine's loop advances one per step)."""
    while doc.waiting:
        assert documents.advance(doc), "the pool cannot hold the document"


def engine_mixed(ctx, job, docs, questions, slots, new, extra=None, graphs=False):
    """One batch of ``questions`` (``(document index, ids)``) over several ``docs``, ``slots``
    at a time, the documents made resident by the batch (``extra``: more of the batch's options):
    rank 0 returns the token ids per question and the batch_done event (with ``extra``, also
    each answer's stop reason). ``graphs``: as :func:`engine_batch`'s."""
    from treeattn_cli.engine.engine import Engine

    got, done, reasons = {}, [], {}

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]] = p[1]["token_ids"]
            # (an answer with no token has no first-token time: the record must not make one up)
            reasons[p[0]] = (
                p[1]["stop_reason"]
                if p[1]["new_tokens"] or p[1]["ttft_s"] is None
                else "no token, yet a first-token time"
            )
        elif kind == "batch_done":
            done.append(p)

    real, ctx.emit = ctx.emit, emit
    try:
        eng = Engine(ctx, job)
        if graphs:
            fake_cuda_graphs(eng.dec, ctx.rank)
        asks = [{"ids": q, "doc": {"key": f"d{d}", "ids": docs[d]}} for d, q in questions]
        eng.serve([greedy_batch(new, slots, questions=asks, **(extra or {})), {"op": "stop"}])
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    if ctx.rank != 0:
        return None
    out = ([got.get(i) for i in range(len(questions))], done)
    return out + ([reasons.get(i) for i in range(len(questions))],) if extra is not None else out
