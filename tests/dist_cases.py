"""Rank functions for the distributed tests (importable by spawned ranks).

Each function runs on every rank with the same seed, builds the same full inputs, keeps its own
shard, and returns numbers for the parent test to check against the one-rank oracle.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch

from treeattn_cli.parallel.comm import Stats, make_comm
from treeattn_cli.engine.prefill import ring_prefill
from treeattn_cli.parallel.ring import chunk_bounds, ring_decode
from treeattn_kernels import partial_attention, partial_attention_ref


def shard_sizes(N, world, seed):
    """Uneven sizes summing to N; rank 1 (if any) holds zero tokens."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(world, generator=g) + 0.2
    if world > 1:
        w[1] = 0
    sizes = (w / w.sum() * N).floor().long()
    sizes[0] += N - sizes.sum()
    return sizes.tolist()


def rel_err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "inf pattern differs"
    return ((a - b).abs()[fin].max() / max(1.0, b.abs()[fin].max())).item() if fin.any() else 0.0


def decode_schemes(ctx, seed, groups=None):
    """Every flat scheme, hierarchical (if groups) and ring decode vs the one-rank oracle.

    Returns rows (case, method, o_err, lse_err, o_bits_digest)."""
    comms = {s: make_comm(s) for s in ("allreduce", "allgather", "tree")}
    if groups:
        for inner in ("allreduce", "tree", "allgather"):
            for outer in ("tree", "allreduce"):
                comms[f"hier-{inner}-{outer}"] = make_comm("hierarchical", groups, inner, outer)
    rows = []
    for B in (1, 3):
        for G in (1, 4):
            for dtype in (torch.float32, torch.bfloat16):
                case = f"B{B}-G{G}-{str(dtype)[6:]}"
                gen = torch.Generator().manual_seed(seed + B * 100 + G * 10 + (dtype == torch.bfloat16))
                H_kv, d, N = 2, 64, 67
                q = torch.randn(B, G * H_kv, 1, d, generator=gen).to(dtype)
                k = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                v = torch.randn(B, H_kv, N, d, generator=gen).to(dtype)
                o_ref, lse_ref = partial_attention_ref(q, k, v)
                sizes = shard_sizes(N, ctx.world, seed)
                a = sum(sizes[: ctx.rank])
                ks, vs = k[:, :, a:a + sizes[ctx.rank]], v[:, :, a:a + sizes[ctx.rank]]
                o_i, lse_i = partial_attention(q, ks, vs)
                outs = {name: c.merge(o_i, lse_i) for name, c in comms.items()}
                outs["ring"] = ring_decode(comms["allreduce"], q, ks, vs)
                for name, (o, lse) in outs.items():
                    every = comms["allgather"].all_gather(torch.cat([o, lse[..., None]], -1))
                    same = all(torch.equal(every[0], e) for e in every)
                    rows.append((case, name, rel_err(o.to(dtype), o_ref), rel_err(lse, lse_ref), same))
    return rows


def allreduce_accounting(ctx, B, H, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    o, lse = torch.randn(B, H, 1, d), torch.randn(B, H, 1)
    stats.reset()
    c.merge(o, lse)
    return stats.snapshot()


def ring_accounting(ctx, B, H_kv, N, d):
    stats = Stats(enabled=True)
    c = make_comm("allreduce", stats=stats)
    q, k, v = torch.randn(B, 4 * H_kv, 1, d), torch.randn(B, H_kv, N, d), torch.randn(B, H_kv, N, d)
    stats.reset()
    ring_decode(c, q, k, v, shard_lens=[N] * ctx.world)
    return stats.snapshot()


def prefill_cases(ctx, seed, lengths):
    """Ring prefill (pass-KV) of prompts of each length, balanced and contiguous pieces, with and
    without a window, vs single-device causal attention; and after a cache (the cache travelling
    with pass-KV, or the queries with pass-Q). Rows (n, sharding, window, cached, o_err, lse_err)."""
    from treeattn_cli.engine.prefill import positions, ring_pass_q, shard
    from treeattn_cli.parallel.merge import merge_pair

    c = make_comm("allreduce")
    rows = []
    for n in lengths:
        for sharding in ("balanced", "contiguous"):
            for window in (None, 5):
                for cached in (0, 1, 9):  # 1: most ranks hold no cached token
                    gen = torch.Generator().manual_seed(seed + n)
                    B, H_kv, G, d = 2, 2, 3, 64
                    N = cached + n
                    q = torch.randn(B, G * H_kv, N, d, generator=gen)
                    k = torch.randn(B, H_kv, N, d, generator=gen)
                    v = torch.randn(B, H_kv, N, d, generator=gen)
                    pos = torch.arange(N)
                    o_ref, lse_ref = partial_attention_ref(q, k, v, q_pos=pos, k_pos=pos, window=window)
                    pieces = shard(cached, n, ctx.world, balanced=sharding == "balanced")
                    mine = positions(pieces[ctx.rank])
                    cb = chunk_bounds(cached, ctx.world)  # the cache: contiguous shards of the first tokens
                    ck, cv = k[:, :, cb[ctx.rank]:cb[ctx.rank + 1]], v[:, :, cb[ctx.rank]:cb[ctx.rank + 1]]
                    lens = [cb[i + 1] - cb[i] for i in range(ctx.world)]
                    travel = cached and window is None
                    o, lse = ring_prefill(c, q[:, :, mine], k[:, :, mine], v[:, :, mine], pieces, window=window,
                                          cache=(ck, cv) if travel else None, cache_lens=lens if travel else None)
                    if cached and not travel:
                        kpos = torch.arange(cb[ctx.rank], cb[ctx.rank + 1]).expand(B, -1)
                        po, pl = ring_pass_q(c, q[:, :, mine], ck, cv, torch.full((B,), ck.shape[2]), pieces,
                                             k_pos=kpos, window=window)
                        o, lse = merge_pair(o, lse, po, pl)
                    err = (rel_err(o, o_ref[:, :, mine]), rel_err(lse, lse_ref[:, :, mine])) if len(mine) else (0.0, 0.0)
                    rows.append((n, sharding, window, cached, *err))
    return rows


def fail_mid_step(ctx, bad_rank, how, stamp=None):
    """Merge once fine, then ``bad_rank`` raises (or is SIGKILLed) while the others merge;
    ``stamp``: a file where it writes the time it fails (the event a deadline counts from)."""
    c = make_comm("allreduce")
    o, lse = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1)
    c.merge(o, lse)
    if ctx.rank == bad_rank:
        if stamp is not None:
            Path(stamp).write_text(repr(time.time()))
        if how == "raise":
            raise ValueError("boom in layer 3")
        os.kill(os.getpid(), signal.SIGKILL)
    c.merge(o, lse)
    c.merge(o, lse)
    return "survived"



def ring_leaves_inputs_alone(ctx, seed):
    """Ring decode must not write into the caller's K/V/lengths (they may be the cache)."""
    from treeattn_cli.parallel.comm import make_comm

    c = make_comm("allreduce")
    g = torch.Generator().manual_seed(seed + ctx.rank)
    k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    kv_len = torch.tensor([9 - ctx.rank])
    before = (k.clone(), v.clone(), kv_len.clone())
    ring_decode(c, torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(seed)), k, v, kv_len,
                shard_lens=[9] * ctx.world)
    return all(torch.equal(a, b) for a, b in zip(before, (k, v, kv_len)))


def rank_and_world(ctx):
    return ctx.rank, ctx.world


def gather_values(ctx):
    from treeattn_cli.parallel.comm import make_comm

    return make_comm("allreduce").all_gather_values([ctx.rank, 0.5 * ctx.rank, 7]).tolist()


def agree(ctx, veto_rank):
    """``Comm.all_true``: one rank's False decides for every rank."""
    c = make_comm("allreduce")
    return c.all_true(True), c.all_true(ctx.rank != veto_rank)


def fail_while_others_block(ctx, stamp=None):
    """Rank 0 raises; the others sit still, as ranks blocked in an NCCL collective do (they
    never notice on their own before the collective timeout). ``stamp``: as in fail_mid_step."""
    if ctx.rank == 0:
        if stamp is not None:
            Path(stamp).write_text(repr(time.time()))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    time.sleep(600)


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


def tp_shards_and_collectives(ctx, model_dir, tp, new_tokens):
    """Under (cp x tp): every linear layer holds 1/tp of its weight on this rank (the dimension
    the model's plan shards), and the collectives of one decode step of ``generate`` (the batch
    loop's step and the broadcast of the step's tokens after it), counted by kind."""
    import torch.distributed as dist

    from treeattn_cli.engine.batch import BatchDecoder
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.job import EngineJob
    from treeattn_cli.engine.model import load_model

    full = load_model(model_dir, torch.float32, torch.device("cpu"))
    job = EngineJob(model_dir, (torch.arange(20) + 30).tolist(), max_new_tokens=new_tokens, dtype="float32",
                      tp=tp, speculate="off")
    eng = Engine(ctx, job)
    shards = {}
    for name, p in eng.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ref = dict(full.named_parameters())[name]
        shards[name] = (tuple(local.shape), tuple(ref.shape))
    counts, steps = {}, []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "send", "recv",
             "batch_isend_irecv", "reduce_scatter_tensor", "broadcast_object_list")
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


def sh_vocab(model):
    return model.get_output_embeddings().weight.shape[0]


def tp_load_memory(ctx, model_dir, tp):
    """Peak anonymous memory this rank gains while loading its tensor-parallel shard, read as
    each parameter is registered (and sampled every few ms between; file-backed pages of the
    checkpoint do not count: they are the page cache); and the bytes of weights it holds."""
    from helpers import peak_anon_growth
    from treeattn_cli.parallel import comm as C
    from treeattn_cli.parallel.mesh import Mesh
    from treeattn_cli.engine.model import load_model, weight_bytes

    mesh = Mesh(ctx.world, tp, ctx.rank)
    tp_mesh, _ = C.grid_mesh("cpu", mesh.cp, tp)
    model, grown = peak_anon_growth(lambda: load_model(model_dir, torch.float32, torch.device("cpu"), tp_mesh=tp_mesh),
                                    probes=[(torch.nn.Module, "register_parameter")])
    return grown, weight_bytes(model)


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
        eng.serve([{"op": "append", "ids": list(job.prompt_ids)},
                   {"op": "decode", "seq": 0, "max_new_tokens": job.max_new_tokens, "sampling": vars(Sampling()),
                    "keep": False}, {"op": "stop"}])
    finally:
        ctx.emit = real
    os.environ.pop("TREEATTN_KERNEL", None)
    graphs = eng.bd.graphs  # (the batch loop's: a single answer is a batch of one)
    state = eng.world.all_gather_values([graphs.held > 0, graphs.on])
    return (answers[0], state.tolist(), graphs.note) if ctx.rank == 0 else None


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
        eng.serve([{"op": "append", "ids": doc + question},
                   {"op": "decode", "seq": 0, "max_new_tokens": new, "sampling": vars(Sampling()), "keep": False,
                    "speculate": speculate}, {"op": "stop"}])
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    if ctx.rank != 0:
        return None
    a, bd = answers[0], eng.bd  # (the batch loop's graphs: a single answer is a batch of one)
    return (a["token_ids"], a.get("speculation"), bd.graphs.replays, bd.verify_graphs.replays,
            (bd.graphs.captures, bd.verify_graphs.captures), bd.graphs.note or bd.verify_graphs.note)


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
        eng.serve([{"op": "append", "ids": doc}]
                  + [{"op": "batch", "questions": questions, "slots": slots, "max_new_tokens": new,
                      "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": speculate,
                      **(extra or {})}] * repeat
                  + [{"op": "stop"}])
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    n = len(questions)
    return ([got.get(i) for i in range(n)], done, [spec.get(i) for i in range(n)]) if ctx.rank == 0 else None


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
        Engine(ctx, job).serve([{"op": "append", "ids": doc},
                                {"op": "batch", "seq": 7, "questions": questions, "slots": slots, "max_new_tokens": new,
                                 "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "interruptible": True},
                                {"op": "stop"}])
    finally:
        ctx.emit = real
    return (got, done) if ctx.rank == 0 else None


def engine_batch_step_positions(ctx, job, doc, questions, slots, new):
    """:func:`engine_batch`, recording the query positions of every one-token-per-slot step of
    the batch; rank 0 returns (answers, [per step: lowest position, how many slots]). """
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


@contextlib.contextmanager
def _triton_path(kernel: str):
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


def triton_sessions(ctx, sessions):
    """:func:`engine_sessions_full` with ``TREEATTN_KERNEL=triton``: the attention kernel GPUs
    run (Triton, interpreted here) for every decode and verify row; every rank returns how many
    times its Triton kernel ran per session, rank 0 the sessions' results too."""
    out, runs = [], []
    with _triton_path("partial_attention_triton") as calls:
        for session in sessions:
            before = calls[0]
            got = engine_sessions_full(ctx, [session])
            out.append(got[0] if got else None)
            runs.append(calls[0] - before)
    return (out if ctx.rank == 0 else None), runs


def _complete(documents, doc) -> None:
    """Every remaining segment of ``doc`` now (the engine's loop advances one per step)."""
    while doc.waiting:
        assert documents.advance(doc), "the pool cannot hold the document"


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
    _complete(eng.documents, d)
    other = eng.documents.new_shard()
    eng.dec.prefill(other, torch.tensor([doc]), piece)
    same = d.cache.max_len == other.max_len and torch.equal(d.cache.counts, other.counts) and all(
        torch.equal(x, y) for layer in range(other.num_layers)
        for x, y in zip(d.cache.view(layer), other.view(layer)))  # k, v, length, positions
    every = eng.world.all_gather_values([int(same)])
    return (bool(every.min()), segs, type(d.cache).__name__) if ctx.rank == 0 else None


def engine_mixed(ctx, job, docs, questions, slots, new, extra=None, graphs=False):
    """One batch of ``questions`` (``(document index, ids)``) over several ``docs``, ``slots``
    at a time, the documents made resident by the batch (``extra``: more of the batch's options):
    rank 0 returns the token ids per question and the batch_done event (with ``extra``, also
    each answer's stop reason). ``graphs``: as :func:`engine_batch`'s."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.sampling import Sampling

    got, done, reasons = {}, [], {}

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]] = p[1]["token_ids"]
            # (an answer with no token has no first-token time: the record must not make one up)
            reasons[p[0]] = p[1]["stop_reason"] if p[1]["new_tokens"] or p[1]["ttft_s"] is None \
                else "no token, yet a first-token time"
        elif kind == "batch_done":
            done.append(p)

    real, ctx.emit = ctx.emit, emit
    try:
        eng = Engine(ctx, job)
        if graphs:
            fake_cuda_graphs(eng.dec, ctx.rank)
        eng.serve([{"op": "batch", "slots": slots, "max_new_tokens": new, "piece": 8,
                    "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": "off",
                    "questions": [{"ids": q, "doc": {"key": f"d{d}", "ids": docs[d]}}
                                  for d, q in questions], **(extra or {})},
                   {"op": "stop"}])
    finally:
        ctx.emit = real
        os.environ.pop("TREEATTN_KERNEL", None)
    if ctx.rank != 0:
        return None
    out = ([got.get(i) for i in range(len(questions))], done)
    return out + ([reasons.get(i) for i in range(len(questions))],) if extra is not None else out


def triton_mixed(ctx, job, docs, questions, slots, new):
    """:func:`engine_mixed` with ``TREEATTN_KERNEL=triton``: the documents' rows of each step, and
    each row's own tokens in the batch's pooled tail, go through the paged Triton kernel
    (interpreted here); every rank returns how many times it ran and how often the tail was read
    through its block tables and gathered into dense views (``{"tables": n, "gathered": n}``),
    rank 0 the batch's result too."""
    from treeattn_cli.engine.paged_tail import PagedTail

    reads = {"tables": 0, "gathered": 0}
    real = {}
    for name, kind in (("step_tables", "tables"), ("rows_tables", "tables"), ("full_tables", "tables"),
                       ("update", "gathered"), ("view_rows", "gathered"), ("full", "gathered")):
        real[name] = getattr(PagedTail, name)

        def counted(self, *a, _f=real[name], _k=kind, **kw):
            reads[_k] += 1
            return _f(self, *a, **kw)

        setattr(PagedTail, name, counted)
    try:
        with _triton_path("partial_attention_triton_paged") as calls:
            got = engine_mixed(ctx, job, docs, questions, slots, new)
    finally:
        for name, f in real.items():
            setattr(PagedTail, name, f)
    return got, calls[0], reads


def document_prefix_reuse(ctx, job, doc_a, extra, piece):
    """Documents sharing a prefix in the block pool (``documents.Documents``): A prefilled;
    B = A + ``extra`` takes A's cached blocks for their common segments; both leave memory and
    come back from their cached blocks, without a prefill; C, A less its last 10 tokens, takes
    A's blocks up to inside a block and writes its own tail into a copy of that block (B holds it
    too); E, A less 15, does the same when no other table holds it: it writes into that block,
    which loses its key; A asked with another ``piece``
    takes nothing. Each time the document's keys, values, positions and counts must equal a
    plain cache prefilled alone with the same ``piece``. Rank 0 returns ``{check: bool or
    number}``, every rank's booleans and-ed."""
    import torch

    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    D = eng.documents

    def plain(ids, pc):
        other = eng.documents.new_shard()
        eng.dec.prefill(other, torch.tensor([ids]), pc)
        return other

    def same(doc, ids, pc=piece):
        ref = plain(ids, pc)
        return bool(doc.cache.max_len == ref.max_len and torch.equal(doc.cache.counts, ref.counts) and all(
            torch.equal(x, y) for layer in range(ref.num_layers) for x, y in zip(doc.cache.view(layer), ref.view(layer))))

    def get(key, ids, pc=piece):
        d = D.get({"key": key, "ids": ids, "piece": pc})
        info = {"source": d.source, "reused": d.reused, "segments": len(d.todo)}
        _complete(D, d)
        return d, info

    out = {}
    a, out["a"] = get("a", doc_a)
    b_ids = doc_a + extra
    b, out["b"] = get("b", b_ids)
    out["b_same"] = same(b, b_ids)
    D._evict("a")
    D._evict("b")
    b2, out["b_again"] = get("b", b_ids)
    out["b_again_same"] = same(b2, b_ids)
    c_ids = doc_a[:len(doc_a) - 10]  # while B holds A's blocks: C's tail goes into a copy
    copies = D.pool.copies
    c, out["c"] = get("c", c_ids)
    out["c_same"] = same(c, c_ids)
    out["c_copied"] = D.pool.copies > copies
    out["c_reads_its_table"] = set((c.cache._slots // D.pool.page).tolist()) == set(c.cache.table.blocks)
    for key in ("b", "c"):
        D._evict(key)
    e_ids = doc_a[:len(doc_a) - 15]  # no table holds A's blocks now: E takes over the partial one
    copies = D.pool.copies
    e, out["e"] = get("e", e_ids)
    out["e_same"] = same(e, e_ids)
    out["e_took_over"] = D.pool.copies == copies
    D._evict("e")
    a2, out["a_again"] = get("a", doc_a)  # C wrote into a copy, E into a block whose key it dropped
    out["a_again_same"] = same(a2, doc_a)
    other, out["other_piece"] = get("a-other-piece", doc_a, piece + 8)
    out["other_piece_same"] = same(other, doc_a, piece + 8)
    for key in ("a", "a-other-piece"):
        D._evict(key)
    if ctx.rank == eng.world.world - 1:  # this rank's pool lost some of B's blocks: it finds fewer
        out["forgot"] = D.pool.forget(b2.keys[2:])
    b3, out["b_uneven"] = get("b", b_ids)
    out["b_uneven_same"] = same(b3, b_ids)
    flags = [v for v in out.values() if isinstance(v, bool)]
    every = eng.world.all_gather_values([int(all(flags))] + [int(v) for v in flags])
    ok = every.min(dim=0).values.tolist()
    names = [k for k, v in out.items() if isinstance(v, bool)]
    return {**out, **{k: bool(x) for k, x in zip(names, ok[1:])}} if ctx.rank == 0 else None


def pool_agreement(ctx, spec, free_by_rank):
    """``Documents.make_pool(spec)`` on every rank, each rank told it has ``free_by_rank[rank]``
    bytes free; returns what each rank made (``{blocks, page, bytes, free}``)."""
    from types import SimpleNamespace

    from treeattn_cli.engine import documents as D
    from treeattn_cli.engine import pool_sizing
    from treeattn_cli.engine.pool import KVFormat
    from treeattn_cli.parallel import comm as C

    world = C.Comm()
    kv = KVFormat(2, 2, 16, torch.float32, None, torch.device("cpu"))
    pool_sizing.free_memory = lambda device, ranks=1: free_by_rank[ctx.rank]
    docs = D.Documents(SimpleNamespace(kv=kv, world=world))
    made = docs.make_pool(spec)
    assert docs.pool.num_blocks == made["blocks"] and docs.make_pool({"pool": 1}) == made  # made once
    return made


def cite_sessions(ctx, sessions):
    """For each ``(job, requests)``: an engine on these ranks serving ``requests``; rank 0 returns,
    per session, every answer's record (``answer`` events, then ``banswer`` ones in question order)
    with its ``token_ids``, ``cite`` masses and ``speculation``."""
    from treeattn_cli.engine.engine import Engine

    out = []
    for job, requests in sessions:
        got, batch = [], {}

        def emit(kind, p, got=got, batch=batch):
            if kind == "answer":
                got.append(p)
            elif kind == "banswer":
                batch[p[0]] = p[1]

        real, ctx.emit = ctx.emit, emit
        try:
            Engine(ctx, job).serve(requests)
        finally:
            ctx.emit = real
        out.append(got + [batch[i] for i in sorted(batch)])
    return out if ctx.rank == 0 else None


def triton_cite_sessions(ctx, sessions, kernel):
    """:func:`cite_sessions` with ``TREEATTN_KERNEL=triton`` and ``partial_triton.<kernel>`` counted:
    rank 0 returns the sessions' answers, every rank how many times the kernel ran."""
    with _triton_path(kernel) as calls:
        got = cite_sessions(ctx, sessions)
    return got, calls[0]


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


class _Reads:
    """Every read of a tensor's values on the host made from code outside torch and Triton (the
    interpreter reads its tensors as it runs kernels in Python): ``int()``, ``float()``,
    ``bool()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``torch.equal``, ``nonzero``, and every
    ``torch.tensor(data, device=...)`` (host data copied to the device); each recorded as
    ``file:function`` of the code that made it."""

    OPS = ("_local_scalar_dense", "item", "equal", "nonzero", "is_nonzero")  # (under inference_mode int() is aten.item)

    def __init__(self):
        self.sites: list[str] = []
        self.on = False

    def site(self):
        import sys

        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if "/torch/" not in name and "/triton/" not in name and not name.endswith("dist_cases.py"):
                return f"{name.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
            if "/triton/" in name:
                return None
            f = f.f_back
        return None

    def record(self):
        if self.on:
            s = self.site()
            if s is not None:
                self.sites.append(s)


def host_reads_per_step(ctx, job, doc, questions, new):
    """The engine's steps on these ranks with ``TREEATTN_KERNEL=triton`` (the GPU's choice of
    kernels), a batch of ``questions`` (token lists over ``doc``, or requests naming a document of
    the block pool: the paged kernel's path) and then one answer alone (the first question): every
    rank returns, per interval between two of the steps' message broadcasts, its device reads
    (``engine.transfers.read``), copies (``transfers.Staging``) and forwards; the copies of host data to the
    device the model's forward made on plain steps (``forward_copies``: none may), and every
    other read of a tensor the requests made, by site (``step_reads``, :class:`_Reads`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from treeattn_cli.engine import transfers
    from treeattn_cli.engine.decode import Decoder
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.sampling import Sampling
    from treeattn_cli.parallel.comm import Comm

    reads, events, step_reads = _Reads(), [], _Reads()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _Reads.OPS:
                step_reads.record()
            return func(*args, **(kwargs or {}))

    real = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy, "forward": Decoder._forward,
            "tensor": torch.tensor, "read": transfers.read, "send": transfers.Staging.send, "broadcast": Comm.broadcast}

    def tolist(t):
        step_reads.record()
        return real["tolist"](t)

    def numpy(t, *a, **kw):
        step_reads.record()
        return real["numpy"](t, *a, **kw)

    def tensor(data, *a, **kw):  # host data made into a device tensor: a copy inside the forward
        if kw.get("device") is not None:
            reads.record()
        return real["tensor"](data, *a, **kw)

    def forward(self, ids, positions, want_logits, rows=1):
        events.append("forward")
        reads.on = self.actx.phase in ("cascade", "decode") and ids.shape[1] == 1  # a plain step
        try:
            return real["forward"](self, ids, positions, want_logits, rows)
        finally:
            reads.on = False

    def read(t):  # the sanctioned read: not one of the strays counted
        events.append("read")
        was, step_reads.on = step_reads.on, False
        try:
            return real["read"](t)
        finally:
            step_reads.on = was

    def send(self, *rows):
        events.append("send")
        return real["send"](self, *rows)

    def broadcast(self, t, src=0):
        events.append("msg")
        return real["broadcast"](self, t, src)

    common = {"max_new_tokens": new, "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": "off"}
    os.environ["TREEATTN_KERNEL"] = "triton"
    torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, Decoder._forward = tolist, numpy, tensor, forward
    transfers.read, transfers.Staging.send, Comm.broadcast = read, send, broadcast
    sent, ctx.emit = ctx.emit, (lambda kind, p: None)
    out = {}
    try:
        eng = Engine(ctx, job)
        eng.serve([{"op": "append", "ids": doc}, {"op": "mark", "name": "doc"}])
        for name, reqs in (("batch", [{"op": "batch", "questions": questions, "slots": len(questions), **common}]),
                           ("alone", [{"op": "append", "ids": questions[0]},
                                      {"op": "decode", "seq": 0, "keep": False, **common},
                                      {"op": "rollback", "name": "doc"}])):
            events.clear()
            step_reads.on = True
            try:
                with Mode():
                    eng.serve(reqs)
            finally:
                step_reads.on = False
            intervals, cur = [], {"read": 0, "send": 0, "forward": 0}
            for e in events:
                if e == "msg":
                    intervals.append(cur)
                    cur = {"read": 0, "send": 0, "forward": 0}
                else:
                    cur[e] += 1
            out[name] = intervals + [cur]
        out["forward_copies"] = sorted(set(reads.sites))
        out["step_reads"] = sorted(set(step_reads.sites))
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, Decoder._forward = (
            real["tolist"], real["numpy"], real["tensor"], real["forward"])
        transfers.read, transfers.Staging.send, Comm.broadcast = real["read"], real["send"], real["broadcast"]
        os.environ.pop("TREEATTN_KERNEL", None)
        ctx.emit = sent
    return out


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
        consistent = int(d.cache.counts[0].sum()) == len(d.ids) and \
            int(d.cache.counts[0][eng.mesh.cp_index]) == d.cache.max_len
        return {"tokens": got[-1]["token_ids"] if eng.lead else None, "kept": got[-1].get("kept") if eng.lead else None,
                "doc_tokens": len(d.ids), "used": eng.documents.pool.used,
                "consistent": eng.world.all_true(consistent), "pending": d.pending, "counts": d.cache.counts[0].tolist()}

    try:
        eng.serve([{"op": "batch", "questions": [{"ids": [], "doc": spec, "max_new_tokens": 0}], **common},
                   {"op": "mark", "name": "doc", "doc": "conv"}])
        start = {"doc_tokens": len(eng.documents.resident["conv"].ids), "used": eng.documents.pool.used}
        turns = [ask(q) for q in questions]
        eng.serve([{"op": "rollback", "name": "doc", "doc": "conv"}])
        reset = {"doc_tokens": len(eng.documents.resident["conv"].ids), "used": eng.documents.pool.used}
        again = ask(questions[0])
    finally:
        ctx.emit = real
    own = len(eng.ids)
    del torch
    return {"start": start, "turns": turns, "reset": reset, "again": again, "own_cache_tokens": own,
            "pool_blocks": eng.documents.pool.num_blocks} if eng.lead else None


def two_kept_questions(ctx, job, doc):
    """A batch keeping two questions over one document: refused before anything runs (the second
    would be answered without the first's turn and fed the same pending token). Rank 0 returns
    the error and the document's tokens before and after."""
    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    spec = {"key": "conv", "ids": list(doc), "piece": len(doc)}
    common = {"slots": 2, "sampling": {}, "stop": [], "eos_ids": [], "max_new_tokens": 3, "pool_for": len(doc),
              "grow": True}
    eng.serve([{"op": "batch", "questions": [{"ids": [], "doc": spec, "max_new_tokens": 0}], **common}])
    before = len(eng.documents.resident["conv"].ids)
    try:
        eng.serve([{"op": "batch", "questions": [{"ids": [21, 22], "doc": spec, "keep": True},
                                                 {"ids": [23], "doc": spec, "keep": True}], **common}])
        err = None
    except ValueError as e:
        err = str(e)
    return {"error": err, "before": before, "after": len(eng.documents.resident["conv"].ids)} if eng.lead else None


def documents_all_pooled(ctx, job, short_docs, short_qs, saved, big, q, new, root):
    """Every document lives in the rank's block pool (issue 35, item 2). One batch of
    ``short_qs`` over ``short_docs`` (some shorter than the sequence shards); then, in a pool of
    8 blocks of 16 tokens, ``saved`` is answered and written through to ``root``, ``big`` takes
    the pool (``saved`` leaves), and ``q`` over ``saved`` again finds no free blocks: its saved
    copy waits for them (``big`` leaves) and is loaded into the pool. Every rank returns the
    kind of each short document's cache; rank 0 also the answers and what became of ``saved``."""
    from treeattn_cli.engine.engine import Engine
    from treeattn_cli.engine.kvstore import model_identity
    from treeattn_cli.engine.sampling import Sampling

    got, sources = {}, {}

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]] = p[1]["token_ids"]
        elif kind == "bdoc":
            sources[p[0]] = p[1]["source"]

    base = {"op": "batch", "max_new_tokens": new, "piece": 8, "sampling": vars(Sampling()), "stop": [],
            "eos_ids": [], "speculate": "off"}
    real, ctx.emit = ctx.emit, emit
    out = {}
    try:
        eng = Engine(ctx, job)
        pool = {"pool_blocks": 8, "page": 16}  # (the first document makes the pool)
        eng.serve([{**base, **pool, "slots": 2, "questions": [{"ids": qq, "doc": {"key": f"s{d}", "ids": short_docs[d]}}
                                                              for d, qq in short_qs]}])
        out["short"] = [got.get(i) for i in range(len(short_qs))]
        out["kinds"] = {k: type(d.cache).__name__ for k, d in eng.documents.resident.items()}
        out["short_counts"] = {k: d.cache.counts[0].tolist() for k, d in eng.documents.resident.items()}
        for k in list(eng.documents.resident):
            eng.documents._evict(k)
        disk = {"dir": str(root), "save": True, **pool,
                "save_meta": {"identity": model_identity(job.model_dir), "composition": {}}}
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


def rank_order_sums(ctx, seed):
    """Issue 49: each rank's rows summed over the group (``Comm.sum_in_rank_order``) alone, and as
    one row of batches of 3 and 40 at several places; returns whether every copy of the row got
    the same bits, and whether a plain SUM all-reduce would have (over 3+ ranks it need not)."""
    from treeattn_cli.parallel.comm import make_comm

    comm = make_comm("allreduce")
    g = torch.Generator().manual_seed(seed + 7 * comm.rank)
    row = torch.randn(1, 9, 65, generator=g) * 1e3  # [1, H, d + 1]: a merge's packed row
    alone = comm.sum_in_rank_order(row.clone())[0]
    plain_alone = comm.all_reduce(row.clone(), "sum")[0]
    same = plain_same = True
    for n in (3, 40):
        for at in (0, n // 2, n - 1):
            batch = torch.randn(n, 9, 65, generator=torch.Generator().manual_seed(seed + n + at + 101 * comm.rank))
            batch[at] = row[0]
            same &= bool(torch.equal(comm.sum_in_rank_order(batch.clone())[at], alone))
            plain_same &= bool(torch.equal(comm.all_reduce(batch.clone(), "sum")[at], plain_alone))
    return same, plain_same


def invariance_runs(ctx, job, doc, questions, new):
    """The same questions over one document (the pool, 2 ranks): each alone (a batch of one, no
    drafts), then as ``chat --batch 3``, ``--batch 1 --speculate ngram:4`` and both; rank 0
    returns each run's answers (digests of each token's logits, tokens, speculation) and its
    batch records."""
    from treeattn_cli.engine.engine import Engine

    eng = Engine(ctx, job)
    spec = {"key": "doc", "ids": doc}
    common = {"max_new_tokens": new, "sampling": {}, "stop": [], "eos_ids": [], "digest": True,
              "pool_for": len(doc)}
    runs = {"alone": [[i] for i in range(len(questions))], "batch3": [list(range(len(questions)))],
            "ngram": [[i] for i in range(len(questions))], "batch3+ngram": [list(range(len(questions)))]}
    out = {}
    for name, groups in runs.items():
        answers, batches = {}, []

        def emit(kind, p):
            if kind == "banswer":
                answers[order[p[0]]] = p[1]
            elif kind == "batch_done":
                batches.append(p)

        ctx.emit = emit
        for order in groups:
            eng.serve([{"op": "batch", "questions": [{"ids": questions[i], "doc": spec} for i in order],
                        "slots": min(3, len(order)), "speculate": "ngram:4" if "ngram" in name else "off",
                        **common}])
        out[name] = {"answers": answers, "batches": batches}
    return out if ctx.rank == 0 else None
