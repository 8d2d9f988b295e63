"""Model-level timing of ``generate``: treeattn on 1..p ranks against transformers' own
``generate`` (SDPA) on the same model, prompt and token count, in one run.

Run: ``python -m treeattn_cli.bench.model --prompt-tokens 4096,8000 --nproc 1,2``
(later ``treeattn bench --model``). Prompts are the shipped demo document, repeated and cut to
the wanted length; decoding is greedy with a fixed number of new tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ..engine import model as M
from ..engine.sampling import Sampling
from ..parallel.launch import run_local
from ..paths import demo_document
from ..engine.engine import rank_generate
from ..engine.job import GenerateJob


def prompt_ids(tokenizer, n: int) -> list[int]:
    doc = tokenizer(demo_document(), add_special_tokens=False)["input_ids"]
    reps = -(-n // len(doc))
    return (doc * reps)[:n]


def time_treeattn(model_dir, ids, new_tokens, nproc, dtype="float32", scheme="allreduce",
                  decode_method="tree", tp=1, speculate="off", kv_dtype="auto"):
    job = GenerateJob(model_dir=str(model_dir), prompt_ids=ids, max_new_tokens=new_tokens,
                      sampling=Sampling(), dtype=dtype, scheme=scheme, decode_method=decode_method, tp=tp,
                      speculate=speculate, kv_dtype=kv_dtype)
    toks = []
    res = run_local(rank_generate, nproc, job, on_event=lambda r, k, v: toks.append(v) if k == "token" else None)
    s = res[0]
    decode_ms = 1e3 / s["decode_tokens_per_s"] if s["decode_tokens_per_s"] else None
    name = f"treeattn nproc={nproc}" + (f" tp={tp}" if tp > 1 else "")
    return {"method": name if decode_method == "tree" else f"ring nproc={nproc}",
            "scheme": scheme if decode_method == "tree" else "ring", "nproc": nproc, "tp": tp,
            "prefill_s": s["prefill_s"], "decode_ms_per_token": decode_ms,
            "weight_bytes": s["weight_bytes"], "peak_rss_bytes": s.get("peak_rss_bytes"),
            "speculation": s.get("speculation"), "kv_dtype": s.get("kv_dtype"),
            "kv_bytes_per_token": s.get("kv_bytes_per_token"), "token_ids": toks}


class _Clock:
    """A transformers streamer that only time-stamps: the first ``put`` is the prompt, then one
    per new token, so prefill and per-token decode times come from the same run."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def time_transformers(model_dir, ids, new_tokens, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    x = torch.tensor([ids])
    clock = _Clock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock)
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: the prompt, before prefill
    return {"method": "transformers sdpa", "prefill_s": first - t0,
            "decode_ms_per_token": 1e3 * (last - first) / (new_tokens - 1),
            "token_ids": out[0, len(ids):].tolist()}


def model_bench(model=None, prompt_tokens=(4096,), nprocs=(1, 2), new_tokens=32):
    model_dir = M.resolve(model)
    tok = M.load_tokenizer(model_dir)
    threads = torch.get_num_threads()
    records = []
    for n in prompt_tokens:
        ids = prompt_ids(tok, n)
        hf = time_transformers(model_dir, ids, new_tokens)
        for p in nprocs:
            r = time_treeattn(model_dir, ids, new_tokens, p)
            r["same_tokens_as_transformers"] = r["token_ids"] == hf["token_ids"]
            records.append({**r, "prompt_tokens": n})
        records.append({**hf, "prompt_tokens": n})
    for r in records:
        r.pop("token_ids")
        r["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", default="4096,8000")
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args(argv)
    recs = model_bench(a.model, [int(x) for x in a.prompt_tokens.split(",")],
                       [int(x) for x in a.nproc.split(",")], a.new_tokens)
    from rich.console import Console
    from rich.table import Table

    t = Table(title="generate: prefill and decode")
    for c in ("prompt", "method", "prefill s", "decode ms/token", "same tokens"):
        t.add_column(c, justify="right")
    for r in recs:
        t.add_row(str(r["prompt_tokens"]), r["method"], f"{r['prefill_s']:.2f}",
                  f"{r['decode_ms_per_token']:.1f}", str(r.get("same_tokens_as_transformers", "-")))
    t.caption = recs[0]["machine"] if recs else ""
    Console().print(t)


if __name__ == "__main__":
    main()
