"""Prefix reuse by block through ``treeattn serve`` (issue 35, item 4), measured as clients see it
(the official ``openai`` client, streaming):

    python -m treeattn_cli.bench.serve_prefix [--model DIR] [--nproc 2] [--doc-tokens 1200] [--json]

(e) a document that extends a cached one (document A, then A followed by a new part B): its first
    token against a cold document of the same length, and the tokens the server reports cached
    (``usage.prompt_tokens_details.cached_tokens``);
(f) a document asked again after the byte budget (``--kv-memory``, about 2.5 documents) took it
    out of the ranks' memory while two others were asked: what of it the pool's cached blocks
    still held (the pool reuses a left document's last blocks first), and its first token against
    its first, cold one.

Consecutive parts of the shipped demo document, as in ``serve_mixed``. Needs ``treeattn[serve]``
and ``openai``. ``--json``: one record per line, as measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from .serve import serving
from .serve_mixed import QUESTIONS, Stream, documents


def kv_bytes_per_token(model_dir) -> int:
    """K and V of one token over all layers, fp32 (serve's dtype on a CPU)."""
    from transformers import AutoConfig

    from ..model.load import shapes

    sh = shapes(AutoConfig.from_pretrained(model_dir))
    return 2 * sh["num_layers"] * sh["kv_heads"] * sh["head_dim"] * 4


def run(model=None, nproc: int = 2, doc_tokens: int = 1200, on_record=None) -> list[dict]:
    import openai

    from ..model.load import load_tokenizer, resolve

    model_dir = resolve(model)
    tok = load_tokenizer(model_dir)
    docs = documents(tok, doc_tokens, 5)
    out: list[dict] = []

    def record(r):
        out.append({**r, "nproc": nproc, "doc_tokens": doc_tokens, "model": str(model or "embedded")})
        if on_record is not None:
            on_record(out[-1])

    budget = int(2.5 * doc_tokens * kv_bytes_per_token(model_dir) / nproc)
    with serving(model, nproc, "--batch", "8", "--kv-memory", str(budget)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id

        def ask(text: str, q: str = QUESTIONS[0], n: int = 8) -> Stream:
            return Stream(client, name, f"{text}\n\n{q}", n).start().wait()

        def cached(s: Stream) -> int:
            d = s.usage.prompt_tokens_details if s.usage else None
            return int(getattr(d, "cached_tokens", 0) or 0)

        # (e) A, then A + B; a cold document of the same length (the parts in another order)
        ask(docs[0])
        extended = ask(f"{docs[0]}\n\n{docs[1]}")
        cold = ask(f"{docs[1]}\n\n{docs[0]}")
        record(
            {
                "measure": "e",
                "extended_prompt_tokens": extended.usage.prompt_tokens,
                "extended_cached_tokens": cached(extended),
                "extended_ttft_s": extended.ttft,
                "cold_prompt_tokens": cold.usage.prompt_tokens,
                "cold_cached_tokens": cached(cold),
                "cold_ttft_s": cold.ttft,
                "speedup": cold.ttft / extended.ttft,
            }
        )
        # (f) a document out of memory by the budget, asked again
        first = ask(docs[2])
        for d in docs[3:5]:
            ask(d)
        again = ask(docs[2], QUESTIONS[1])
        record(
            {
                "measure": "f",
                "cache_bytes_per_rank": budget,
                "first_ttft_s": first.ttft,
                "again_ttft_s": again.ttft,
                "again_prompt_tokens": again.usage.prompt_tokens,
                "again_cached_tokens": cached(again),
                "speedup": first.ttft / again.ttft,
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--doc-tokens", type=int, default=1200)
    ap.add_argument("--json", action="store_true", help="one JSON record per line, as measured")
    a = ap.parse_args(argv)
    run(a.model, a.nproc, a.doc_tokens, on_record=lambda r: print(json.dumps(r), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
