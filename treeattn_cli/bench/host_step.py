"""Time of a batched decode step, eager or replayed from CUDA graphs, and the step's reads of the
device (issue 38).

Run: ``python -m treeattn_cli.bench.host_step [--nproc 1,2] [--batch 8] [--repeats 5]`` on CPU
ranks, or ``--device cuda --random llama-1b --batch 1,8,32 --graphs off,on`` on GPUs (one per
rank, NCCL). A random Llama (default: 2 layers, hidden 64, where the device work is nothing, so
a step's time is the host's: Python, the model's modules, the merges' collectives) answers
``--batch`` questions about one ``--doc-tokens`` document, all decoding together (``chat
--batch``'s batch), greedy. A step's time is marginal: a batch of ``--tokens`` tokens each less
one of 8, over the difference in steps (what a batch costs once, its questions' prefill and its
graphs' capture, cancels), median of ``--repeats`` pairs after a warm-up. With ``--scheme auto``
the engine plans as ``--scheme auto`` does (``auto_layout``: steps that no graph replays merge
with one all-gather). Also: the reads of the device (``engine.transfers.read``) and host-to-device
copies (``host.Staging``) each rank makes a step, and the graphs the batch replayed.

``--cache pool`` (the default: what ``chat --batch`` and ``serve`` run) names the document in
every question: it is made resident in the rank's block pool, the batch's tail there too
(``paged_tail``; on a GPU both are read through block tables); ``--cache own`` appends it as the
engine's own tokens and the questions continue them (since issue 50 a document of the same pool,
``Engine.prefix``); ``own,pool`` times both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ..engine.job import EngineJob
from ..engine.sampling import Sampling
from ..parallel.launch import run_local

SHORT = 8  # tokens of the shorter batch of a pair


def _doc(n: int) -> list[int]:
    return [(13 * i + 5) % 230 + 20 for i in range(n)]


def rank_batches(ctx, job, doc, questions, new, repeats, pool=False):
    """Every rank: the document, a warm-up batch, then ``repeats`` pairs of timed batches
    (``new`` tokens each, then ``SHORT``); each rank returns the seconds of each pair, its reads
    and copies per step (over the long batches), and rank 0 the long batches' graph replays.
    ``pool``: the document named by every question, its pool sized for it and the batch, as
    ``chat --batch`` sizes it; else appended as the engine's own tokens (pooled too)."""
    import torch

    from ..engine.engine import Engine

    try:
        from ..engine import transfers as host
    except ImportError:  # an older tree (the "before" of BENCHMARKS.md): host.py, or before it
        try:
            from ..engine import host
        except ImportError:
            host = None
    eng = Engine(ctx, job)
    done = []
    real, ctx.emit = ctx.emit, (lambda kind, p: done.append(p) if kind == "batch_done" else None)
    req = {
        "op": "batch",
        "questions": questions,
        "slots": len(questions),
        "max_new_tokens": new,
        "sampling": vars(Sampling()),
        "stop": [],
        "eos_ids": [],
        "speculate": "off",
    }
    first = [{"op": "append", "ids": doc}]
    if pool:  # every question names the document: it is made resident in the pool by the warm-up
        req.update(
            questions=[{"ids": q, "doc": {"key": "bench", "ids": doc}} for q in questions],
            pool_for=len(doc),
            tails=max(len(q) for q in questions) + new,
            tail_slots=len(questions),
        )
        first = []
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)  # the batch's end, timed
    try:
        eng.serve([*first, {**req, "max_new_tokens": 4}])
        pairs, per, replays = [], {}, []
        for _ in range(repeats):
            secs = []
            for n in (new, SHORT):
                before = dict(host.COUNTS) if host else {}
                done.clear()
                sync()
                t0 = time.perf_counter()
                eng.serve([{**req, "max_new_tokens": n}])
                sync()
                secs.append(time.perf_counter() - t0)
                if n == new:
                    per = {k: (host.COUNTS[k] - before[k]) / n for k in before} if host else {}
                    replays.append(done[0].get("graph_replays", 0) if done else 0)
            pairs.append(secs)
    finally:
        ctx.emit = real
    return {"pairs": pairs, "per_step": per, "graph_replays": replays}


def make_model(random: str | None) -> Path:
    """The model of the runs: a random Llama of shape ``random``, or the tiny one."""
    from ..verify import tiny
    from .random_model import random_model

    root = Path(tempfile.mkdtemp(prefix="treeattn-host-step-"))
    return random_model(random, root / "m") if random else tiny.make_model("llama", root / "m", seed=3)


def measure(
    nproc: int,
    batch: int,
    new: int,
    repeats: int,
    scheme: str,
    *,
    device: str = "cpu",
    random: str | None = None,
    graphs: bool = False,
    doc_tokens: int = 100,
    model=None,
    pool: bool = True,
) -> dict:
    model = model or make_model(random)
    qs = [[(29 * i + 11 + j) % 230 + 20 for i in range(5)] for j in range(batch)]
    cuda = device == "cuda"
    job = EngineJob(
        str(model),
        [],
        dtype="bfloat16" if cuda else "float32",
        max_new_tokens=new,
        reserve=doc_tokens + 256,
        scheme="allreduce" if scheme == "auto" else scheme,
        auto_layout=scheme == "auto",
        cuda_graph=graphs,
    )
    got = run_local(
        rank_batches,
        nproc,
        job,
        _doc(doc_tokens),
        qs,
        new,
        repeats,
        pool,
        timeout_s=1200,
        backend="nccl" if cuda else "gloo",
        devices=[f"cuda:{i}" for i in range(nproc)] if cuda else None,
    )
    ms = [1e3 * (a - b) / (new - SHORT) for a, b in got[0]["pairs"]]
    return {
        "device": device,
        "model": random or "tiny",
        "nproc": nproc,
        "batch": batch,
        "doc_tokens": doc_tokens,
        "scheme": scheme,
        "graphs": graphs,
        "cache": "pool" if pool else "own",
        "ms_per_step": statistics.median(ms),
        "samples": ms,
        "graph_replays": got[0]["graph_replays"],
        "per_step": [r["per_step"] for r in got],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--batch", default="8", help="a comma list of batch sizes")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scheme", default="auto", help="auto (as --scheme auto plans) | allreduce | allgather | tree")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--random", default=None, help="a random model of this shape (bench.random_model.SHAPES)")
    ap.add_argument("--doc-tokens", type=int, default=100)
    ap.add_argument("--graphs", default="off", help="off | on | off,on: the batch's steps replayed from CUDA graphs")
    ap.add_argument(
        "--cache",
        default="pool",
        help="pool | own | own,pool: the document named by every question, "
        "or appended as the engine's own tokens (both in the pool)",
    )
    a = ap.parse_args(argv)
    caches = [c.strip() for c in a.cache.split(",")]
    if not caches or any(c not in ("own", "pool") for c in caches):
        ap.error("--cache takes pool, own or own,pool")
    if a.tokens <= SHORT:
        ap.error(f"--tokens must be more than {SHORT}")
    modes = [m.strip() for m in a.graphs.split(",")]
    if not modes or any(m not in ("off", "on") for m in modes):
        ap.error("--graphs takes off, on or off,on")
    if "on" in modes and a.device != "cuda":
        ap.error("--graphs on needs --device cuda (CUDA graphs)")
    model = make_model(a.random)
    for n in [int(x) for x in a.nproc.split(",")]:
        for b in [int(x) for x in a.batch.split(",")]:
            for c in caches:
                for m in modes:
                    print(
                        json.dumps(
                            measure(
                                n,
                                b,
                                a.tokens,
                                a.repeats,
                                a.scheme,
                                device=a.device,
                                random=a.random,
                                graphs=m == "on",
                                doc_tokens=a.doc_tokens,
                                model=model,
                                pool=c == "pool",
                            )
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
