"""Time to first token through ``treeattn serve`` (issue 26): a document asked about once (its
prefill), then again with other questions (the document cache), measured by a streaming client.

    python -m treeattn_cli.bench.serve [--model DIR] [--nproc 2] [--doc-tokens 1500]
                                       [--questions 3] [--new-tokens 16] [--json]

Starts ``treeattn serve`` on a free loopback port (the embedded model and the demo document by
default, cut at a paragraph), waits for ``/health``, then sends the questions one after another as chat requests
``document + "\\n\\n" + question``, streaming: per request, seconds from sending to the first
content chunk and to the end, and the cached tokens the usage reports. Needs ``treeattn[serve]``
(FastAPI, uvicorn, httpx). ``--random SHAPE``: a random-weight model of that shape
(``random_model.py``), for a GPU machine that holds no weights. The server picks the device as
``serve`` does (the GPUs when there are any). ``--json``: one record per line, as measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .random_model import add_model_flags, model_from_flags

QUESTIONS = [
    "Who chose the site of the observatory?",
    "What happened to the first telescope?",
    "Name two people who worked there.",
    "When was the observatory founded?",
    "What is the ridge made of?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, model: str, text: str, new_tokens: int) -> dict:
    """One streamed chat request: seconds to the first content chunk and to the end, usage."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, usage, pieces = None, None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    if first is None:
                        first = time.perf_counter() - t0
                    pieces.append(c["delta"]["content"])
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "ttft_s": first,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": cached,
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "text": "".join(pieces),
    }


def wait_until_serving(proc, url: str, stderr, within_s: float = 300.0) -> None:
    """Until the server ``proc`` at ``url`` answers ``/health`` (the event); a server that exits
    first raises with the end of ``stderr()``, one that takes longer than ``within_s`` too."""
    import httpx

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(stderr()[-2000:])
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > within_s:
            raise RuntimeError(f"the server did not come up in {within_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def serving(model=None, nproc: int = 2, *flags: str):
    """``treeattn serve`` on a free loopback port until the block ends: yields ``(url, the
    server's process)`` once ``/health`` answers."""
    port = _free_port()
    treeattn = str(Path(sys.executable).with_name("treeattn"))
    cmd = [treeattn, "serve", "--nproc", str(nproc), "--port", str(port), "--quiet", "--log-format", "none", *flags]
    if model:
        cmd += ["--model", str(model)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, lambda: proc.stderr.read().decode())
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(
    model=None, nproc: int = 2, doc_tokens: int = 1500, questions: int = 3, new_tokens: int = 16, on_record=None
) -> list[dict]:
    import httpx

    from ..model.load import load_tokenizer, resolve
    from .spec import demo_document_cut

    model_dir = resolve(model)
    doc = demo_document_cut(load_tokenizer(model_dir), doc_tokens)
    with serving(model, nproc) as (url, _):
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        out = []
        for i in range(questions):
            q = QUESTIONS[i % len(QUESTIONS)]
            r = ask(url, name, f"{doc}\n\n{q}", new_tokens)
            out.append({"request": i + 1, "question": q, **r, "nproc": nproc, "model": str(model or "embedded")})
            if on_record is not None:
                on_record(out[-1])
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    add_model_flags(ap, device=False)  # the server picks its device as `serve` does
    ap.add_argument("--json", action="store_true", help="one JSON record per line, as measured")
    a = ap.parse_args(argv)
    model, _, _ = model_from_flags(ap, a)
    recs = run(
        model,
        a.nproc,
        a.doc_tokens,
        a.questions,
        a.new_tokens,
        on_record=(lambda r: print(json.dumps(r), flush=True)) if a.json else None,
    )
    if a.json:
        return 0
    print("| request | prompt tokens | cached | first token s | whole answer s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in recs:
        print(
            f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']:.3f} | {r['total_s']:.3f} |"
        )
    later = [r["ttft_s"] for r in recs[1:] if r["ttft_s"]]
    if later and recs[0]["ttft_s"]:
        print(
            f"\nfirst token: request 1 {recs[0]['ttft_s']:.2f} s, later requests median "
            f"{statistics.median(later):.2f} s ({recs[0]['ttft_s'] / statistics.median(later):.1f}x sooner)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
