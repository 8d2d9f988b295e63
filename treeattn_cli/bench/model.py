"""Model-level timing of ``generate``: treeattn on 1..p ranks against transformers' own
``generate`` (SDPA) on the same model, prompt, token count, device and dtype, in one run.

Run: ``python -m treeattn_cli.bench.model --prompt-tokens 4096,8000 --nproc 1,2``
(later ``treeattn bench --model``). Prompts are the shipped demo document, repeated and cut to
the wanted length; decoding is greedy with a fixed number of new tokens. ``--device`` (auto: the
GPU in bf16 when there is one, ranks over NCCL, transformers on the same GPU; else CPU ranks in
fp32), ``--kv-dtypes auto,fp8`` (a row per cache storage), ``--random SHAPE`` (a random-weight
model of that shape, ``random_model.py``: a GPU machine that holds no weights), ``--json``
(one record per line as measured: a run stopped at its limit keeps what it printed).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ..model import load as M
from ..engine.sampling import Sampling
from ..parallel.launch import run_local
from ..paths import demo_document
from ..engine.engine import rank_generate
from ..engine.job import EngineJob
from .random_model import add_model_flags, model_from_flags


def prompt_ids(tokenizer, n: int) -> list[int]:
    doc = tokenizer(demo_document(), add_special_tokens=False)["input_ids"]
    reps = -(-n // len(doc))
    return (doc * reps)[:n]


def time_treeattn(
    model_dir,
    ids,
    new_tokens,
    nproc,
    dtype="float32",
    scheme="allreduce",
    decode_method="tree",
    tp=1,
    speculate="off",
    kv_dtype="auto",
    device="cpu",
):
    job = EngineJob(
        model_dir=str(model_dir),
        prompt_ids=ids,
        max_new_tokens=new_tokens,
        sampling=Sampling(),
        dtype=dtype,
        scheme=scheme,
        decode_method=decode_method,
        tp=tp,
        speculate=speculate,
        kv_dtype=kv_dtype,
    )
    toks = []
    devices = [f"cuda:{r}" for r in range(nproc)] if device == "cuda" else ["cpu"] * nproc
    res = run_local(
        rank_generate,
        nproc,
        job,
        backend="nccl" if device == "cuda" else "gloo",
        devices=devices,
        on_event=lambda r, k, v: toks.append(v) if k == "token" else None,
    )
    s = res[0]
    decode_ms = 1e3 / s["decode_tokens_per_s"] if s["decode_tokens_per_s"] else None
    name = f"treeattn nproc={nproc}" + (f" tp={tp}" if tp > 1 else "")
    return {
        "method": name if decode_method == "tree" else f"ring nproc={nproc}",
        "scheme": scheme if decode_method == "tree" else "ring",
        "nproc": nproc,
        "tp": tp,
        "prefill_s": s["prefill_s"],
        "decode_ms_per_token": decode_ms,
        "weight_bytes": s["weight_bytes"],
        "peak_rss_bytes": s.get("peak_rss_bytes"),
        "speculation": s.get("speculation"),
        "kv_dtype": s.get("kv_dtype"),
        "kv_bytes_per_token": s.get("kv_bytes_per_token"),
        "token_ids": toks,
    }


class _Clock:
    """A transformers streamer that only time-stamps: the first ``put`` is the prompt, then one
    per new token, so prefill and per-token decode times come from the same run. On a GPU each
    stamp waits for the device first (``put`` is handed the token before it is computed)."""

    def __init__(self, device="cpu"):
        self.stamps = []
        self.sync = torch.device(device).type == "cuda"

    def put(self, value):
        if self.sync:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def time_transformers(model_dir, ids, new_tokens, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    x = torch.tensor([ids], device=device)
    clock = _Clock(device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = m.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            streamer=clock,
            output_scores=True,
            return_dict_in_generate=True,
        )
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: the prompt, before prefill
    return {
        "method": "transformers sdpa",
        "prefill_s": first - t0,
        "decode_ms_per_token": 1e3 * (last - first) / (new_tokens - 1),
        "token_ids": out.sequences[0, len(ids) :].tolist(),
        "scores": [sc[0].float().cpu() for sc in out.scores],
    }  # [vocab] logits per step


def divergence(ours: list, hf: dict) -> dict:
    """Where ``ours`` first differs from transformers' greedy tokens, and how close transformers'
    own choice was there: ``margin`` = its logit of its token minus its logit of ours (a near tie,
    against the logits' scale ``logit_scale``, is a rounding difference of a low-precision dtype;
    a large one is a wrong answer). Empty when they agree."""
    ref = hf["token_ids"]
    i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return {} if len(ours) == len(ref) else {"first_divergence": min(len(ours), len(ref))}
    sc = hf["scores"][i]
    return {
        "first_divergence": i,
        "margin": round(float(sc[ref[i]] - sc[ours[i]]), 4),
        "logit_scale": round(float(sc.abs().max()), 3),
    }


def machine(device: str, nproc) -> str:
    """The machine a record was measured on, in words."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {nproc} rank(s)"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads in this process, {nproc} rank(s)"
    )


def model_bench(
    model=None,
    prompt_tokens=(4096,),
    nprocs=(1, 2),
    new_tokens=32,
    device="cpu",
    dtype="float32",
    kv_dtypes=("auto",),
    on_record=None,
):
    """Records per prompt length: treeattn per rank count and cache storage, then transformers;
    ``on_record(rec)`` as each is measured."""
    model_dir = M.resolve(model)
    tok = M.load_tokenizer(model_dir)
    records = []

    def emit(r):
        r = {k: v for k, v in r.items() if k not in ("token_ids", "scores")}
        r.update(machine=machine(device, r.get("nproc", 1)), device=device, dtype=dtype)
        records.append(r)
        if on_record is not None:
            on_record(r)

    for n in prompt_tokens:
        ids = prompt_ids(tok, n)
        hf = time_transformers(model_dir, ids, new_tokens, getattr(torch, dtype), device)
        for p in nprocs:
            for kv in kv_dtypes:
                r = time_treeattn(model_dir, ids, new_tokens, p, dtype=dtype, kv_dtype=kv, device=device)
                r["same_tokens_as_transformers"] = r["token_ids"] == hf["token_ids"]
                r.update(divergence(r["token_ids"], hf))
                emit({**r, "prompt_tokens": n})
        emit({**hf, "prompt_tokens": n})
    return records


def main(argv=None):
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    add_model_flags(p)
    p.add_argument("--prompt-tokens", default="4096,8000")
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv-dtypes", default="auto", help="comma list of cache storages (auto, bfloat16, fp8, ...)")
    p.add_argument("--json", action="store_true", help="one JSON record per line, as measured")
    a = p.parse_args(argv)
    model, device, dtype = model_from_flags(p, a)
    recs = model_bench(
        model,
        [int(x) for x in a.prompt_tokens.split(",")],
        [int(x) for x in a.nproc.split(",")],
        a.new_tokens,
        device,
        dtype,
        [k for k in a.kv_dtypes.split(",") if k],
        on_record=(lambda r: print(json.dumps(r), flush=True)) if a.json else None,
    )
    if a.json:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="generate: prefill and decode")
    for c in ("prompt", "method", "KV", "prefill s", "decode ms/token", "same tokens"):
        t.add_column(c, justify="right")
    for r in recs:
        t.add_row(
            str(r["prompt_tokens"]),
            r["method"],
            str(r.get("kv_dtype") or "-"),
            f"{r['prefill_s']:.2f}",
            f"{r['decode_ms_per_token']:.1f}",
            str(r.get("same_tokens_as_transformers", "-")),
        )
    t.caption = recs[0]["machine"] if recs else ""
    Console().print(t)


if __name__ == "__main__":
    main()
