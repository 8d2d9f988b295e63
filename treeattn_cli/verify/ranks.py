"""The checks of ``treeattn check`` that need ranks: every merge scheme and ring decode over this
run's ranks against the one-rank oracle (and bit-identical on every rank), a tiny random model
through ``generate``'s real path and through a batch of questions against transformers' greedy
decode (CUDA graph on and off on GPUs), and the same model in bf16 with an fp8 cache through the fast kernels against the same
run on the reference kernels."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .kernels import TOL, _NAMES, _fp8_refusal, _record, rel_err, skipped


def dist_rank(ctx, seed: int):
    """Rank function: every merge scheme and ring decode over this run's ranks vs the one-rank
    oracle (the reference on the whole cache); rank 0 returns the records."""
    from treeattn_kernels import partial_attention, partial_attention_ref

    from ..parallel.comm import make_comm
    from ..parallel.ring import chunk_bounds, ring_decode

    dev = torch.device(ctx.device)
    p = ctx.world
    half = max(1, p // 2)
    comms = {s: make_comm(s) for s in ("allreduce", "allgather", "tree")}
    comms["hierarchical"] = make_comm("hierarchical", [list(range(half)), list(range(half, p))] if p > 1 else [[0]])
    gen = torch.Generator().manual_seed(seed)
    out = []
    for dt in (torch.float32, torch.bfloat16):
        B, H_kv, G, d, N = 2, 2, 4, 64, 4099
        q, k, v = (
            torch.randn(*s, generator=gen).to(dev, dt) for s in ((B, G * H_kv, 1, d), (B, H_kv, N, d), (B, H_kv, N, d))
        )
        ref_o, ref_l = partial_attention_ref(q.float(), k.float(), v.float())
        b = chunk_bounds(N, p)
        ks, vs = k[:, :, b[ctx.rank] : b[ctx.rank + 1]], v[:, :, b[ctx.rank] : b[ctx.rank + 1]]
        o_i, lse_i = partial_attention(q, ks, vs, out_dtype=torch.float32)
        lens = [b[i + 1] - b[i] for i in range(p)]
        runs = {f"merge/{s}": (lambda c=c: c.merge(o_i, lse_i)) for s, c in comms.items()}
        runs["ring-decode"] = lambda: ring_decode(comms["allreduce"], q, ks, vs, shard_lens=lens)
        for path, fn in runs.items():
            t0 = time.perf_counter()
            o, lse = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            secs = time.perf_counter() - t0
            err = max(rel_err(o.to(dt), ref_o), rel_err(lse, ref_l))
            every = comms["allgather"].all_gather(torch.cat([o.float(), lse.float()[..., None]], -1))
            same = all(torch.equal(every[0], e) for e in every)
            rec = _record(
                path,
                f"{p} ranks G={G} d={d} N={N} {_NAMES[dt]} B={B}",
                err,
                TOL[dt],
                secs,
                "" if same else "results differ between ranks",
            )
            if not same:
                rec["verdict"] = "FAIL"
            out.append(rec)
    return out if ctx.rank == 0 else None


def generate_checks(nproc: int, backend: str, devices: list[str], workdir: Path) -> list[dict]:
    """A tiny random Llama (GQA) through ``generate``'s real path on these ranks vs
    transformers' greedy decode on the CPU, with the CUDA graph on and off on GPUs."""
    from ..parallel.launch import run_local
    from ..engine.engine import rank_generate
    from ..engine.job import EngineJob
    from .tiny import hf_greedy, make_model

    model = make_model(
        "llama", workdir / "tiny-llama", head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    ids = [(7 * i + 3) % 250 for i in range(61)]
    want = hf_greedy(model, ids, 16)
    graph_modes = (False, True) if devices[0].startswith("cuda") else (False,)
    out = []
    for graph in graph_modes:
        t0 = time.perf_counter()
        toks, note = [], ""
        try:
            res = run_local(
                rank_generate,
                nproc,
                EngineJob(str(model), ids, max_new_tokens=16, dtype="float32", cuda_graph=graph),
                backend=backend,
                devices=devices,
                timeout_s=120,
                on_event=lambda r, kind, v: toks.append(v) if kind == "token" else None,
            )
            if graph and not res[0].get("cuda_graph"):
                note = res[0].get("note", "the CUDA graph was not used")
        except Exception as e:
            note = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        same = toks == want and not note
        rec = {
            "path": f"generate/{'cuda-graph' if graph else 'eager'}",
            "case": f"tiny llama, {nproc} ranks, 61+16 tokens",
            "max_err": None,
            "tol": None,
            "seconds": round(time.perf_counter() - t0, 3),
            "verdict": "pass" if same else "FAIL",
            "note": note
            or (
                ""
                if same
                else f"token ids differ from transformers at "
                f"{next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), len(toks))}"
            ),
        }
        out.append(rec)
    if not devices[0].startswith("cuda"):  # listed, as every GPU-only row is, with why it did not run
        out.append(skipped("generate/cuda-graph", "no GPU: the CUDA-graph decode step runs on CUDA devices"))
    if not devices[0].startswith("cuda") or _fp8_refusal(torch.device(devices[0])) is None:
        out.append(_fp8_generate_check(model, ids, nproc, backend, devices))
    out += _batch_checks(model, ids, nproc, backend, devices)
    return out


def batch_rank(ctx, job, doc, questions, slots, new):
    """Rank function: ``questions`` about ``doc`` answered ``slots`` at a time, the batch ``chat
    --batch`` and ``serve`` run: the document in the ranks' block pool, each question's tokens in
    blocks of it too (on a GPU both read through block tables, the steps captured or not); rank 0
    returns each answer's token ids and the batch's record."""
    from ..engine.engine import Engine
    from ..engine.sampling import Sampling

    got, done = {}, []

    def emit(kind, p):
        if kind == "banswer":
            got[p[0]] = p[1]["token_ids"]
        elif kind == "batch_done":
            done.append(p)

    real, ctx.emit = ctx.emit, emit
    try:
        Engine(ctx, job).serve(
            [
                {
                    "op": "batch",
                    "questions": [{"ids": q, "doc": {"key": "check", "ids": doc}} for q in questions],
                    "slots": slots,
                    "max_new_tokens": new,
                    "sampling": vars(Sampling()),
                    "stop": [],
                    "eos_ids": [],
                    "speculate": "off",
                    "pool_for": len(doc),
                    "tails": max(len(q) for q in questions) + new,
                    "tail_slots": slots,
                },
                {"op": "stop"},
            ]
        )
    finally:
        ctx.emit = real
    return ([got.get(i) for i in range(len(questions))], done[0]) if ctx.rank == 0 else None


def _batch_checks(model, doc, nproc: int, backend: str, devices: list[str]) -> list[dict]:
    """Three questions after the document, two at a time (a slot frees and takes the third), over
    the block pool: each answer against transformers' greedy decode of document + question; on
    GPUs with the batch's steps eager and replayed from CUDA graphs (which must have replayed)."""
    from ..parallel.launch import run_local
    from ..engine.job import EngineJob
    from .tiny import hf_greedy

    qs = [[(11 * i + 5 + j) % 250 for i in range(n)] for j, n in enumerate((3, 9, 5))]
    want = [hf_greedy(model, doc + q, 8) for q in qs]
    out = []
    for graph in (False, True) if devices[0].startswith("cuda") else (False,):
        t0 = time.perf_counter()
        got, note = [], ""
        try:
            got, rec = run_local(
                batch_rank,
                nproc,
                EngineJob(str(model), [], max_new_tokens=8, dtype="float32", cuda_graph=graph),
                doc,
                qs,
                2,
                8,
                backend=backend,
                devices=devices,
                timeout_s=120,
            )[0]
            if graph and (rec.get("graph_note") or not rec.get("graph_replays")):
                note = rec.get("graph_note") or "no step was replayed from a CUDA graph"
        except Exception as e:
            note = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None) if got else 0
        same = got == want and not note
        out.append(
            {
                "path": f"batch/{'cuda-graph' if graph else 'eager'}",
                "case": f"tiny llama, {nproc} ranks, the block pool, 3 questions 2 at a time, 8 tokens each",
                "max_err": None,
                "tol": None,
                "seconds": round(time.perf_counter() - t0, 3),
                "verdict": "pass" if same else "FAIL",
                "note": note or ("" if same else f"answer {bad} differs from transformers"),
            }
        )
    if not devices[0].startswith("cuda"):
        out.append(skipped("batch/cuda-graph", "no GPU: batched steps are captured on CUDA devices"))
    return out


NEAR_TIE = 0.05  # nats: two tokens this close are a tie that bf16 rounding may break either way


def _fp8_generate_check(model, ids, nproc, backend, devices) -> dict:
    """``generate --dtype bfloat16 --kv-dtype fp8`` through the fast kernels against the same run
    on the reference kernels (the same rounding of the cache; only the kernels differ). The
    token ids must agree; where they part, the reference's own logprobs must show a near tie
    (within :data:`NEAR_TIE`) between the two choices, which bf16 may break either way."""
    from ..engine.engine import rank_generate
    from ..engine.job import EngineJob
    from ..parallel.launch import run_local

    t0 = time.perf_counter()
    runs = {}
    try:
        for reference in (False, True):
            job = EngineJob(
                str(model),
                ids,
                max_new_tokens=16,
                dtype="bfloat16",
                kv_dtype="fp8",
                logprobs=2,
                reference=reference,
                speculate="off",
            )
            runs[reference] = run_local(rank_generate, nproc, job, backend=backend, devices=devices, timeout_s=120)[0]
        note, ok = _fp8_agreement(runs[False], runs[True])
    except Exception as e:
        note, ok = f"{type(e).__name__}: {e}".splitlines()[0][:160], False
    return {
        "path": "generate/fp8",
        "case": f"tiny llama bf16, fp8 KV, {nproc} ranks, fast vs reference kernels",
        "max_err": None,
        "tol": None,
        "seconds": round(time.perf_counter() - t0, 3),
        "verdict": "pass" if ok else "FAIL",
        "note": note,
    }


def _fp8_agreement(fast: dict, ref: dict) -> tuple[str, bool]:
    """``(note, agreed)`` of two runs' answers (their ``logprobs`` carry the token ids)."""
    if not str(fast.get("kv_dtype")).startswith("fp8") or not str(ref.get("kv_dtype")).startswith("fp8"):
        return f"the runs stored {fast.get('kv_dtype')} and {ref.get('kv_dtype')}, not fp8", False
    a, b = [t["id"] for t in fast["logprobs"]], [t["id"] for t in ref["logprobs"]]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return ("" if len(a) == len(b) else "answers of different lengths"), len(a) == len(b)
    top = dict((int(t), lp) for t, lp in ref["logprobs"][i]["top"])
    gap = top[b[i]] - top[a[i]] if a[i] in top else float("inf")
    return (
        f"token {i}: {a[i]} against the reference's {b[i]}, {gap:.3f} nats apart"
        + (" (a near tie)" if gap <= NEAR_TIE else "")
    ), gap <= NEAR_TIE
