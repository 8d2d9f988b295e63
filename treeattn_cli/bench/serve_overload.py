"""``treeattn serve`` under overload, and what ``/metrics`` costs (issue 36):

    python -m treeattn_cli.bench.serve_overload [--model DIR] [--nproc 2] [--requests 32] [--json]

(o) ``--requests`` concurrent requests about one cached document against a server of ``--batch 2
    --max-waiting 2``: how many were refused (429), how long a refusal took from the client's
    send over an open connection (goal: under 50 ms, the median; the maximum is reported),
    that every accepted answer equals the same request sent alone afterwards, and that the server
    then answers normally;
(m) the gaps between the tokens of one long streamed answer, with a client scraping ``/metrics``
    every second (a tight Prometheus interval; the default is 15 s) against none, alternated
    (goal: no measurable difference), and what one scrape takes.

Needs ``treeattn[serve]``. ``--json``: one record per line, as measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from .serve import serving
from .serve_mixed import Stream, documents


def run(model=None, nproc: int = 2, requests: int = 32, on_record=None) -> list[dict]:
    import httpx
    import openai

    from ..model.load import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model))
    doc = documents(tok, 600, 1)[0]
    out: list[dict] = []

    def record(r):
        out.append({**r, "nproc": nproc, "model": str(model or "embedded")})
        if on_record is not None:
            on_record(out[-1])

    with serving(model, nproc, "--batch", "2", "--max-waiting", "2") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id

        def body(i: int) -> dict:
            return {
                "model": name,
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"{doc}\n\nQuestion {i}: who is named here?"}],
            }

        httpx.post(f"{url}/v1/chat/completions", json=body(-1), timeout=600)  # the document, cached
        # (o) overload
        results: list = [None] * requests
        gate = threading.Barrier(requests)

        def one(i: int):
            with httpx.Client(timeout=600) as http:  # connected before the clock starts
                http.get(f"{url}/health")
                payload = json.dumps(body(i)).encode()
                gate.wait()
                t0 = time.perf_counter()
                r = http.post(
                    f"{url}/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
                )
                took = time.perf_counter() - t0
            results[i] = (
                r.status_code,
                took,
                r.headers.get("retry-after"),
                r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None,
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [r for r in results if r[0] == 429]
        accepted = [(i, r) for i, r in enumerate(results) if r[0] == 200]
        alone = {
            i: httpx.post(f"{url}/v1/chat/completions", json=body(i), timeout=600).json()["choices"][0]["message"][
                "content"
            ]
            for i, _ in accepted
        }
        after = httpx.post(f"{url}/v1/chat/completions", json=body(requests), timeout=600)
        record(
            {
                "measure": "o",
                "requests": requests,
                "accepted": len(accepted),
                "refused_429": len(refused),
                "other": len(results) - len(accepted) - len(refused),
                "refusal_ms_median": 1000 * statistics.median(r[1] for r in refused) if refused else None,
                "refusal_ms_max": 1000 * max(r[1] for r in refused) if refused else None,
                "retry_after_s": sorted({r[2] for r in refused}),
                "answers_equal_alone": all(r[3] == alone[i] for i, r in accepted),
                "after_status": after.status_code,
                "met": bool(refused)
                and statistics.median(r[1] for r in refused) < 0.05
                and all(r[3] == alone[i] for i, r in accepted)
                and after.status_code == 200,
            }
        )

        # (m) a long answer's token gaps, with and without a scraper
        def gaps(scrape: bool) -> list[float]:
            stop = threading.Event()
            scrapes = [0]

            def scraper():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    httpx.get(f"{url}/metrics", timeout=10)
                    took.append(time.perf_counter() - t0)
                    scrapes[0] += 1
                    stop.wait(1.0)

            t = threading.Thread(target=scraper, daemon=True)
            if scrape:
                t.start()
            s = Stream(client, name, f"{doc}\n\nRetell this part in detail.", 120).start().wait()
            stop.set()
            if scrape:
                t.join()
            return [b - a for a, b in zip(s.stamps, s.stamps[1:])], scrapes[0]

        took: list[float] = []
        without, with_, n = [], [], 0
        for _ in range(2):  # alternated, so drift in the machine's speed falls on both
            without += gaps(False)[0]
            g, k = gaps(True)
            with_ += g
            n += k
        record(
            {
                "measure": "m",
                "median_gap_ms_without": 1000 * statistics.median(without),
                "median_gap_ms_with_scraper": 1000 * statistics.median(with_),
                "mean_gap_ms_without": 1000 * statistics.mean(without),
                "mean_gap_ms_with_scraper": 1000 * statistics.mean(with_),
                "scrapes": n,
                "scrape_ms_median": 1000 * statistics.median(took) if took else None,
                "tokens_each": 120,
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="one JSON record per line, as measured")
    a = ap.parse_args(argv)
    recs = run(a.model, a.nproc, a.requests, on_record=lambda r: print(json.dumps(r), flush=True))
    return 0 if all(r.get("met", True) for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
