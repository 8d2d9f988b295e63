"""Host time of a batched decode step, and the step's reads of the device (issue 38).

Run: ``python -m treeattn_cli.bench.host_step [--nproc 1,2] [--batch 8] [--repeats 5]``. A tiny
random Llama (2 layers, hidden 64: the device work is nothing, so a step's time is the host's:
Python, the model's modules, the merges' collectives) answers ``--batch`` questions about one
100-token document, all decoding together (``chat --batch``'s batch), greedy, ``--tokens`` each;
the time per step is the batch's time over its steps (median of ``--repeats`` batches after a
warm-up). With ``--scheme auto`` the engine plans as ``--scheme auto`` does (``auto_layout``:
steps that no graph replays merge with one all-gather). Also: the reads of the device
(``engine.host.read``) and host-to-device copies (``host.Staging``) each rank makes a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ..engine.job import GenerateJob
from ..engine.sampling import Sampling
from ..parallel.launch import run_local

DOC = [(13 * i + 5) % 230 + 20 for i in range(100)]


def rank_batches(ctx, job, questions, new, repeats):
    """Every rank: the document, a warm-up batch, then ``repeats`` timed batches; each rank
    returns the seconds of each and its reads and copies per step."""
    from ..engine.engine import Engine

    try:
        from ..engine import host
    except ImportError:  # a tree from before host.py (the "before" of BENCHMARKS.md)
        host = None
    eng = Engine(ctx, job)
    real, ctx.emit = ctx.emit, (lambda kind, p: None)
    req = {"op": "batch", "questions": questions, "slots": len(questions), "max_new_tokens": new,
           "sampling": vars(Sampling()), "stop": [], "eos_ids": [], "speculate": "off"}
    try:
        eng.serve([{"op": "append", "ids": DOC}, {**req, "max_new_tokens": 4}])
        secs = []
        before = dict(host.COUNTS) if host else {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            eng.serve([req])
            secs.append(time.perf_counter() - t0)
    finally:
        ctx.emit = real
    steps = repeats * new
    per = {k: (host.COUNTS[k] - before[k]) / steps for k in before} if host else {}
    return {"seconds": secs, "per_step": per}


def measure(nproc: int, batch: int, new: int, repeats: int, scheme: str) -> dict:
    from ..verify import tiny

    root = Path(tempfile.mkdtemp(prefix="treeattn-host-step-"))
    model = tiny.make_model("llama", root / "m", seed=3)
    qs = [[(29 * i + 11 + j) % 230 + 20 for i in range(5)] for j in range(batch)]
    job = GenerateJob(str(model), [], dtype="float32", max_new_tokens=new, reserve=256,
                      scheme="allreduce" if scheme == "auto" else scheme, auto_layout=scheme == "auto")
    got = run_local(rank_batches, nproc, job, qs, new, repeats, timeout_s=1200)
    ms = [1e3 * s / new for s in got[0]["seconds"]]
    return {"nproc": nproc, "batch": batch, "scheme": scheme, "ms_per_step": statistics.median(ms), "samples": ms,
            "per_step": [r["per_step"] for r in got]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scheme", default="auto", help="auto (as --scheme auto plans) | allreduce | allgather | tree")
    a = ap.parse_args(argv)
    for n in [int(x) for x in a.nproc.split(",")]:
        print(json.dumps(measure(n, a.batch, a.tokens, a.repeats, a.scheme)), flush=True)


if __name__ == "__main__":
    main()
