"""Time to first token of a question over a document made resident three ways (issue 52): by a
prefill, by a copy back from the host tier, by a load from ``--cache-dir``; and (``--longer``) over a
longer document that begins with it, by loading its first segments from its saved copy and
prefilling the rest, against a fresh prefill of that longer document.

On ``--nproc`` CPU ranks (gloo) of the embedded model (or ``--model``), for each document length
(``--tokens``: the demo document's tokens, repeated and cut): the question is asked over the
document (a prefill, its copy written to a temporary cache directory as a server writes it), the
document leaves the pool for the host tier (its cached blocks forgotten), the question again
(``host``); the document leaves memory altogether, the question again (``disk``). With ``--longer F``: a document
``F`` times as long again (the same tokens, then more of the demo's) asked over, its first
segments from the saved copy (``prefix``), then out of memory, its cached blocks forgotten and the
copy removed, asked over again (``longer prefilled``). Each time is from the request to its first
token, on rank 0, the model loaded; the answers' first tokens over a document must be equal. Prints
a table, or JSON lines (``--json``).

    python -m treeattn_cli.bench.tiers [--tokens 4539,32768] [--nproc 2] [--dtype float32] [--longer 0.125]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

QUESTION = "\n\nWhich city is named in the first paragraph?"


def tiers_rank(ctx, job, docs: list, question: list, pool_bytes: int, root: str, longer: list | None = None):
    """Every rank: for each document of ``docs`` (token ids), ``question`` over it made resident
    by a prefill, from the host tier, from disk; and over ``longer[i]`` (a document beginning
    with ``docs[i]``, if given) by its first segments from the saved copy, then by a prefill.
    Rank 0 returns ``[{tokens, prefill_s, host_s, disk_s, sources, first}]`` (and ``longer_tokens,
    prefix_s, longer_prefill_s, loaded, longer_first``)."""
    from ..engine.engine import Engine
    from ..storage.kvstore import model_identity
    from ..engine.sampling import Sampling
    from ..engine.requests import document_key

    state: dict = {}

    def emit(kind, p):
        if kind == "btoken" and "first" not in state:
            state["first"], state["token"] = time.perf_counter(), p[1]
        elif kind == "bdoc":
            state["source"] = p[1]["source"]

    real, ctx.emit = ctx.emit, emit
    out = []
    try:
        eng = Engine(ctx, job)
        spec = {
            "op": "batch",
            "max_new_tokens": 1,
            "sampling": vars(Sampling()),
            "stop": [],
            "eos_ids": [],
            "speculate": "off",
            "slots": 1,
            "pool": pool_bytes,
            "host_memory": pool_bytes,
            "dir": root,
            "save": True,
            "save_meta": {"identity": model_identity(job.model_dir), "composition": {}},
        }

        def ask(key, ids):
            state.clear()
            t0 = time.perf_counter()
            eng.serve([{**spec, "questions": [{"ids": question, "doc": {"key": key, "ids": ids}}]}])
            return state.get("first", time.perf_counter()) - t0, state.get("source"), state.get("token")

        for i, ids in enumerate(docs):
            key = document_key(ids)
            docs_ = eng.documents
            row = {"tokens": len(ids)}
            row["prefill_s"], s1, t1 = ask(key, ids)
            keys = docs_.resident[key].keys
            docs_._evict(key)  # out of the pool: a copy in the host tier
            if keys:
                docs_.pool.forget(keys)  # (its blocks no longer found in the pool)
            row["host_s"], s2, t2 = ask(key, ids)
            docs_.act({"key": key, "ids": ids, "action": "drop"})  # out of memory: pool and host tier
            row["disk_s"], s3, t3 = ask(key, ids)
            docs_.act({"key": key, "ids": ids, "action": "drop"})
            row["sources"], row["first"] = [s1, s2, s3], [t1, t2, t3]
            if longer:  # its first segments from the copy just saved, the rest prefilled; then all prefilled
                big, loads = longer[i], docs_.prefix_loads
                row["longer_tokens"] = len(big)
                row["prefix_s"], _, t4 = ask(document_key(big), big)
                row["loaded"] = docs_.prefix_loads - loads
                docs_.act({"key": document_key(big), "ids": big, "action": "drop"})
                if ctx.rank == 0:
                    import shutil

                    for name in (key, document_key(big)):
                        shutil.rmtree(f"{root}/{name}", ignore_errors=True)
                eng.world.barrier()
                row["longer_prefill_s"], _, t5 = ask(document_key(big), big)
                docs_.act({"key": document_key(big), "ids": big, "action": "drop"})
                row["longer_first"] = [t4, t5]
            out.append(row)
        eng.serve([{"op": "stop"}])
    finally:
        ctx.emit = real
    return out if ctx.rank == 0 else None


def documents(tokenizer, lengths: list[int]) -> list[list[int]]:
    """The demo document's tokens, repeated to each length and cut there."""
    from importlib.resources import files

    text = files("treeattn_cli.data").joinpath("demo_document.txt").read_text()
    base = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [(base * (n // len(base) + 1))[:n] for n in lengths]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4539,32768", help="document lengths, comma-separated")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded model)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--longer",
        type=float,
        default=0.0,
        help="also a document this fraction longer, beginning with each (its first segments from the saved copy)",
    )
    a = ap.parse_args(argv)
    from ..engine.job import EngineJob
    from ..model.load import load_config, load_tokenizer, resolve, shapes
    from ..parallel.launch import run_local

    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # (the ranks load the model: no bars)
    model_dir = resolve(a.model)  # (the embedded model when none: converted once, cached)
    tokenizer = load_tokenizer(model_dir)
    lengths = [int(x) for x in a.tokens.split(",")]
    docs = documents(tokenizer, lengths)
    longer = documents(tokenizer, [n + max(1, int(n * a.longer)) for n in lengths]) if a.longer > 0 else None
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    sh = shapes(load_config(model_dir))
    per_token = 2 * sh["num_layers"] * sh["kv_heads"] * sh["head_dim"] * (4 if a.dtype == "float32" else 2)
    pool = int(1.3 * max(lengths) / a.nproc * per_token) + (64 << 20)  # the longest document and a tail
    job = EngineJob(str(model_dir), [], dtype=a.dtype, max_new_tokens=1)
    with tempfile.TemporaryDirectory(prefix="treeattn-tiers-") as root:
        rows = run_local(
            tiers_rank, a.nproc, job, docs, question, int(pool * (1 + a.longer)), root, longer, timeout_s=3600
        )[0]
    import torch

    machine = f"{a.nproc} CPU rank(s), torch {torch.__version__}, {torch.get_num_threads()} threads"
    bad = [r for r in rows if r["sources"] != ["prefill", "host", "disk"] or len(set(r["first"])) != 1]
    bad += [r for r in rows if longer and len(set(r["longer_first"])) != 1]
    for r in rows:
        r.update(machine=machine, host_speedup=r["prefill_s"] / r["host_s"], disk_speedup=r["prefill_s"] / r["disk_s"])
        if a.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['tokens']:>7,} tokens: prefill {r['prefill_s']:7.2f} s | host {r['host_s']:6.3f} s "
                f"({r['host_speedup']:5.1f}x sooner) | disk {r['disk_s']:6.3f} s ({r['disk_speedup']:5.1f}x) "
                f"| {' '.join(r['sources'])}"
            )
            if longer:
                print(
                    f"{r['longer_tokens']:>7,} tokens beginning with it: prefilled {r['longer_prefill_s']:7.2f} s | "
                    f"first segments from its copy, the rest prefilled {r['prefix_s']:6.3f} s "
                    f"({r['longer_prefill_s'] / r['prefix_s']:5.1f}x sooner{'' if r['loaded'] else '; none loaded'})"
                )
    if not a.json:
        print(f"[{machine}; the model {model_dir.name}, {a.dtype}]")
    if bad:
        print(f"treeattn bench tiers: error: not made as asked or other first tokens: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
