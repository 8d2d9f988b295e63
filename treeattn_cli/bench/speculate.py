"""Speculative decoding, measured: treeattn's ``--speculate off | auto`` against transformers'
greedy decode with and without prompt lookup (``prompt_lookup_num_tokens``), on the same model,
document and questions, in one run; decode time only (prefill excluded), same tokens checked.

Run: ``python -m treeattn_cli.bench.speculate [--model M] [--doc-tokens 2000] [--new-tokens 128]``.
Three requests about the shipped demo document (an original text, Apache-2.0): a copy-heavy one
(repeat its first paragraph), one asked not to quote it, and one in its own words whose drafts
are mostly rejected. Defaults: the embedded model, one rank (``--nproc``); ``--device auto``:
the GPU in bf16 when there is one (transformers on the same GPU), else the CPU in fp32;
``--random SHAPE``: a random-weight model of that shape (``random_model.py``), for a GPU machine
that holds no weights; ``--json``: one record per line, as measured.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..model import load as M
from .model import _Clock, time_treeattn
from .random_model import add_model_flags, model_from_flags
from .spec import demo_document_cut

SPECS = ("off", "auto", "ngram:10")
REQUESTS = {
    "copy": "Repeat the first paragraph of the document above, word for word.",
    "fresh": "Without quoting the document, write four lines of a song about a lighthouse keeper's dog.",
    # drafts are found but mostly wrong (~1 in 5 kept by ngram:10 here): the case auto must not lose
    "own words": "Explain in your own words how a telescope works, for a child.",
}


def _prompt(tokenizer, text: str) -> list[int]:
    """The tokens ``generate --chat`` would make of ``text`` (``--no-chat`` without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text)["input_ids"]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def time_transformers_lookup(model_dir, ids, new_tokens, lookup: int, device="cpu", dtype="float32"):
    """transformers' greedy ``generate`` (SDPA) with ``prompt_lookup_num_tokens=lookup`` (0: off):
    decode ms per token after the first, and the token ids."""
    from transformers import AutoModelForCausalLM

    m = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    x = torch.tensor([ids], device=device)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    clock = _Clock(device)
    with torch.inference_mode():
        out = m.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=new_tokens,
            streamer=clock,
            **kw,
        )
    toks = out[0, len(ids) :].tolist()
    first, last = clock.stamps[1], clock.stamps[-1]  # [0]: the prompt; [1]: the first new token(s)
    return {"decode_ms_per_token": 1e3 * (last - first) / max(1, len(toks) - 1), "token_ids": toks}


def speculate_bench(
    model=None, doc_tokens=2000, new_tokens=128, nproc=1, device="cpu", dtype="float32", on_record=None
) -> list[dict]:
    """Records per request and method; ``on_record(rec)`` as each request's are complete."""
    from .model import machine

    model_dir = M.resolve(model)
    tok = M.load_tokenizer(model_dir)
    doc = demo_document_cut(tok, doc_tokens)
    records = []
    for name, question in REQUESTS.items():
        ids = _prompt(tok, f"{doc}\n\n{question}")
        runs = {}
        for spec in SPECS:
            r = time_treeattn(model_dir, ids, new_tokens, nproc, dtype=dtype, speculate=spec, device=device)
            runs[f"treeattn {spec}"] = r
        for lookup in (0, 10):
            runs[f"transformers lookup={lookup}"] = time_transformers_lookup(
                model_dir, ids, new_tokens, lookup, device, dtype
            )
        base = runs["treeattn off"]
        for method, r in runs.items():
            rec = {
                "request": name,
                "method": method,
                "prompt_tokens": len(ids),
                "new_tokens": len(r["token_ids"]),
                "decode_ms_per_token": r["decode_ms_per_token"],
                "speedup_vs_off": base["decode_ms_per_token"] / r["decode_ms_per_token"],
                "speculation": r.get("speculation"),
                "same_tokens_as_off": r["token_ids"] == base["token_ids"],
                "machine": machine(device, nproc),
                "device": device,
                "dtype": dtype,
            }
            records.append(rec)
            if on_record is not None:
                on_record(rec)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--nproc", type=int, default=1)
    add_model_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON record per line, as measured")
    a = p.parse_args(argv)
    model, device, dtype = model_from_flags(p, a)
    recs = speculate_bench(
        model,
        a.doc_tokens,
        a.new_tokens,
        a.nproc,
        device,
        dtype,
        on_record=(lambda r: print(json.dumps(r), flush=True)) if a.json else None,
    )
    if a.json:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="speculative decoding: decode ms/token (prefill excluded)")
    for c in ("request", "method", "ms/token", "× off", "drafts accepted", "same tokens as off"):
        t.add_column(c, justify="right")
    for r in recs:
        s = r["speculation"] or {}
        acc = f"{s['accepted']}/{s['drafted']}" if s.get("drafted") else "-"
        t.add_row(
            r["request"],
            r["method"],
            f"{r['decode_ms_per_token']:.1f}",
            f"{r['speedup_vs_off']:.2f}",
            acc,
            str(r["same_tokens_as_off"]),
        )
    t.caption = recs[0]["machine"] if recs else ""
    Console().print(t)


if __name__ == "__main__":
    main()
