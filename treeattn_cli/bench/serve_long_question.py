"""A long question while another answer streams, through ``treeattn serve`` (issue 35, the
per-round token budget), measured as clients see it (the official ``openai`` client):

    python -m treeattn_cli.bench.serve_long_question [--model DIR] [--nproc 2]
                                                     [--question-tokens 1200] [--json]

User A streams a long answer over a cached document. User B sends a prompt of about
``--question-tokens`` tokens with no paragraph break, so none of it is a document: all of it is a
question, prefilled in the batch's tail. Measured: A's longest pause between two tokens while
B's question is prefilled, A's median gap, and B's time to first token, during A and alone.
With the budget, B's question goes in chunks of ``--prefill-chunk`` tokens (default 128 on a CPU),
one per round between A's steps; before it, A waited for the whole question's forward.

Needs ``treeattn[serve]`` and ``openai``. ``--json``: one record per line.
"""

from __future__ import annotations

import argparse
import json
import sys

from .serve import serving
from .serve_mixed import LONG, Stream, documents


def long_question(tokenizer, n_tokens: int) -> str:
    """A question of about ``n_tokens`` tokens without a blank line: the demo document's
    sentences joined on one line, then what to do with them."""
    from ..paths import demo_document

    words, out = demo_document().replace("\n", " ").split(), []
    for w in words:
        out.append(w)
        if len(out) % 64 == 0 and len(tokenizer(" ".join(out))["input_ids"]) >= n_tokens:
            break
    return " ".join(out) + " Which of these names comes first?"


def run(
    model=None, nproc: int = 2, question_tokens: int = 1200, long_tokens: int = 120, on_record=None, flags: tuple = ()
) -> list[dict]:
    import openai

    from ..model.load import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model))
    doc = documents(tok, 1200, 1)[0]
    question = long_question(tok, question_tokens)
    out: list[dict] = []
    with serving(model, nproc, "--batch", "8", *flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        Stream(client, name, f"{doc}\n\n{LONG}", 1).start().wait()  # A's document cached
        alone = Stream(client, name, question, 8).start().wait()
        a = Stream(client, name, f"{doc}\n\n{LONG}", long_tokens).start()
        a.began.wait()
        b = Stream(client, name, question, 8).start().wait()
        a.wait()
        gaps = sorted(y - x for x, y in zip(a.stamps, a.stamps[1:]))
        out.append(
            {
                "question_tokens": b.usage.prompt_tokens if b.usage else None,
                "nproc": nproc,
                "a_longest_pause_s": a.longest_pause(b.t0, b.first or b.end),
                "a_median_gap_s": gaps[len(gaps) // 2] if gaps else None,
                "a_tokens": len(a.stamps),
                "b_ttft_during_a_s": b.ttft,
                "b_ttft_alone_s": alone.ttft,
                "flags": list(flags),
                "model": str(model or "embedded"),
            }
        )
        if on_record is not None:
            on_record(out[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--question-tokens", type=int, default=1200)
    ap.add_argument("--long-tokens", type=int, default=120)
    ap.add_argument("--prefill-chunk", type=int, help="the server's --prefill-chunk (default: its own)")
    ap.add_argument("--json", action="store_true", help="one JSON record per line")
    a = ap.parse_args(argv)
    flags = ("--prefill-chunk", str(a.prefill_chunk)) if a.prefill_chunk else ()
    show = (
        (lambda r: print(json.dumps(r), flush=True))
        if a.json
        else (
            lambda r: print(
                f"A's longest pause {r['a_longest_pause_s']:.2f} s (median gap {r['a_median_gap_s']:.3f} s) while a "
                f"{r['question_tokens']}-token question was prefilled; its first token {r['b_ttft_during_a_s']:.2f} s "
                f"(alone {r['b_ttft_alone_s']:.2f} s)"
            )
        )
    )
    run(a.model, a.nproc, a.question_tokens, a.long_tokens, on_record=show, flags=flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
