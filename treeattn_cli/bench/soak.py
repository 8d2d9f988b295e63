"""``treeattn serve`` under a soak: concurrent clients, bad input and faults, every answer checked
(issue 53).

    python -m treeattn_cli.bench.soak [--model DIR] [--seconds 1200] [--clients 8] [--seed 0]
                                      [--faults kill,stop,term] [--nproc 2] [--json]

Starts a server of its own (``--batch 4 --max-waiting 4``, a ``--cache-dir``, ``--restarts 3``),
records each request of a seeded catalogue *alone* (one at a time, before the soak: the oracle),
then for ``--seconds`` runs ``--clients`` threads, each drawing from a seeded mix: questions over
documents of three lengths (the official ``openai`` client and raw HTTP, streamed or not, greedy
and seeded sampling, stop strings), streams cancelled after a few tokens, documents API churn
(post, pin, TTL, delete while questions stream), bursts past ``--max-waiting`` (429), oversized
bodies (413), malformed requests (400), unknown document ids (404). Every answer that completes
must equal its alone answer, and every refusal must be one the docs name (503 only ``recovering``,
while new ranks start). Faults, each once, spread over the soak: ``kill`` (SIGKILL of a rank
mid-answer: the server starts new ones), ``stop`` (SIGSTOP of a rank past the collective
``--timeout``, then SIGCONT: the others stop it, new ranks start), ``full`` (the cache
directory's filesystem filled: writes there fail with one line, answers go on; needs
``--cache-dir`` on a small filesystem of its own), ``term`` (SIGTERM at the end,
streams running: the server ends, its process tree gone). A stream with no byte for 30 s (but
while a rank is stopped: nothing moves until the server notices, after ``--timeout``), or a
request not streamed with no answer in 120 s, is a hang. The table: requests by outcome, answers checked and equal, time to first token and per
token (p50, p99, streamed requests), each rank's peak RSS at the start and the end, the pool's
blocks in use at the end against the pinned documents', restarts, hangs.

Exit status 0 when no answer differed, nothing hung and every refusal was a documented one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .serve import _free_port, wait_until_serving
from ..parallel.launch import alive
from .serve_mixed import _descendants

KEY = "soak-key"
HANG_S = 30.0  # a stream with no byte for this long is a hang
STOP_GRACE_S = 15.0  # past --timeout: the launcher's look at the heartbeats (1 s), its grace (5 s), a restart's start
ANSWER_S = 120.0  # a request not streamed sends its bytes at the end: no answer in this long is a hang
QUESTIONS = [
    "Who is named first?",
    "What happened next?",
    "Name a place.",
    "Say it in one line.",
    "Which year is given?",
    "What is the ridge made of?",
]


@dataclass
class Spec:
    """One request of the catalogue: its document (index), question, sampling and length."""

    doc: int
    question: str
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop: list = field(default_factory=list)

    def body(self, docs: list[str], name: str, stream: bool) -> dict:
        b = {
            "model": name,
            "prompt": f"{docs[self.doc]}\n\n{self.question}",
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stream": stream,
        }
        if self.stop:
            b["stop"] = self.stop
        return b


class Tally:
    """Outcomes, checks and timings, from every client thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.checked = self.equal = 0
        self.differ: list[str] = []
        self.undocumented: list[str] = []
        self.hangs: list[str] = []
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def bad(self, what: str, status: int, text: str) -> None:
        with self.lock:
            self.undocumented.append(f"{what}: HTTP {status} {text[:300]}")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.tally = Tally()
        self.stop_at = 0.0
        self.work = Path(tempfile.mkdtemp(prefix="treeattn-soak-"))
        self.cache = Path(a.cache_dir) / f"soak-{os.getpid()}" if a.cache_dir else self.work / "cache"
        self.start_s = None  # seconds from the server's launch to its serving
        self.ballast: Path | None = None  # the full fault's file, removed before the soak ends
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.name = ""
        self.stop_noticed_s: float | None = None  # the stop fault: how long until the server noticed
        # while a rank is stopped nothing moves until the others give up on it (--timeout): a stream
        # may go that long without a byte then, and is a hang only when its silence was outside it
        self.stops: list[tuple[float, float]] = []  # (SIGSTOP, the server noticed + grace)
        self.back_s: list[float] = []  # after each killed rank: seconds until /health said ok again
        self.read_s = HANG_S if "stop" not in a.faults.split(",") else max(HANG_S, a.timeout + STOP_GRACE_S + 10)

    # -- the server ------------------------------------------------------------------------------
    def start(self) -> None:
        import httpx

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        treeattn = str(Path(sys.executable).with_name("treeattn"))
        cmd = [
            treeattn,
            "serve",
            "--nproc",
            str(self.a.nproc),
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--cache-dir",
            str(self.cache),
            "--batch",
            "4",
            "--max-waiting",
            "4",
            "--max-request-bytes",
            "65536",
            "--restarts",
            "3",
            "--timeout",
            str(self.a.timeout),
            "--log-format",
            "none",
            "--quiet",
        ]
        if self.a.model:
            cmd += ["--model", str(self.a.model)]
        if self.a.dtype:
            cmd += ["--dtype", self.a.dtype]
        self.log = open(self.work / "server.log", "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, stdin=subprocess.DEVNULL)
        wait_until_serving(self.proc, self.url, (self.work / "server.log").read_text)
        self.start_s = round(time.monotonic() - t0, 1)  # the server's start: the model's load, the ranks'
        self.name = httpx.get(f"{self.url}/v1/models", headers=self._auth()).json()["data"][0]["id"]

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {KEY}"}

    def ranks(self) -> list[int]:
        """The server's rank processes: the children of its fork server."""
        out = []
        for p in _descendants(self.proc.pid):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
                kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            except OSError:
                continue
            if b"forkserver" in cmd:
                out += [int(k) for k in kids]
        return sorted(out)

    def rss(self) -> list[int]:
        """Each rank's peak resident MiB (VmHWM)."""
        out = []
        for p in self.ranks():
            try:
                line = next(x for x in Path(f"/proc/{p}/status").read_text().splitlines() if x.startswith("VmHWM"))
                out.append(int(line.split()[1]) // 1024)
            except (OSError, StopIteration):
                pass
        return out

    # -- the catalogue and its oracle ----------------------------------------------------------
    def catalogue(self) -> None:
        from ..model.load import load_tokenizer, resolve
        from .serve_mixed import documents

        tok = load_tokenizer(resolve(self.a.model))
        parts = documents(tok, 400, 3)
        self.docs = [parts[0][: len(parts[0]) // 3], parts[1][: 2 * len(parts[1]) // 3], parts[2]]
        specs = []
        for i in range(self.a.catalogue):
            r = random.Random(self.a.seed * 1000 + i)
            sampled = r.random() < 0.4
            specs.append(
                Spec(
                    r.randrange(3),
                    r.choice(QUESTIONS),
                    r.randint(4, 24),
                    temperature=0.8 if sampled else 0.0,
                    seed=r.randrange(1 << 20),
                    stop=[r.choice([".", "\n", " the"])] if r.random() < 0.25 else [],
                )
            )
        self.specs = specs
        self.alone = [self._complete(s, stream=False)[1] for s in specs]
        if any(x is None for x in self.alone):
            raise RuntimeError(
                "a request of the catalogue failed alone: " + (self.work / "server.log").read_text()[-1500:]
            )

    def _complete(
        self, spec: Spec, stream: bool, cancel_after: int | None = None, official: bool = False
    ) -> tuple[str, str | None]:
        """One request: (outcome, its text when it completed)."""
        import httpx

        body = spec.body(self.docs, self.name, stream)
        try:
            if not stream and official:  # the official client, as an application would call it
                import openai

                client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=ANSWER_S)
                try:
                    out = client.completions.create(**{k: v for k, v in body.items() if k != "stream"})
                except openai.APIStatusError as e:
                    return self._refusal(
                        "completion (openai)", e.status_code, e.response.text, e.response.headers
                    ), None
                except openai.APITimeoutError:
                    raise httpx.ReadTimeout("no answer") from None
                except openai.APIConnectionError:
                    return "connection_lost", None
                return "completed", out.choices[0].text
            if not stream:
                r = httpx.post(
                    f"{self.url}/v1/completions",
                    headers=self._auth(),
                    json=body,
                    timeout=httpx.Timeout(10.0, read=ANSWER_S),
                )
                if r.status_code == 200:
                    return "completed", r.json()["choices"][0]["text"]
                return self._refusal("completion", r.status_code, r.text, r.headers), None
            t0 = time.monotonic()
            text, stamps, err, prev, stall = [], [], None, t0, 0.0
            with httpx.stream(
                "POST",
                f"{self.url}/v1/completions",
                headers=self._auth(),
                json=body,
                timeout=httpx.Timeout(10.0, read=self.read_s),
            ) as r:
                if r.status_code != 200:
                    r.read()
                    return self._refusal("stream", r.status_code, r.text, r.headers), None
                for line in r.iter_lines():
                    now = time.monotonic()
                    if now - prev > HANG_S and not self._stopped_between(prev, now):
                        stall = max(stall, now - prev)  # no byte for so long, and no rank stopped meanwhile
                    prev = now
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        err = chunk["error"]["message"]
                        continue
                    for c in chunk.get("choices") or []:
                        if c.get("text"):
                            text.append(c["text"])
                            stamps.append(time.monotonic())
                    if cancel_after is not None and len(stamps) >= cancel_after:
                        return "cancelled", None  # the client leaves: the connection closes
            if stall:
                with self.tally.lock:
                    self.tally.hangs.append(f"stream over document {spec.doc}: no byte for {stall:.0f} s")
                return "hang", None
            if err is not None:
                return "ended_by_fault", None  # a rank was lost under it: it said why
            if stamps:
                with self.tally.lock:
                    self.tally.ttft.append(stamps[0] - t0)
                    self.tally.tpot += [b - a for a, b in zip(stamps, stamps[1:])]
            return "completed", "".join(text)
        except httpx.ReadTimeout:
            with self.tally.lock:
                self.tally.hangs.append(
                    f"stream over document {spec.doc}: no byte in {self.read_s:.0f} s"
                    if stream
                    else f"completion over document {spec.doc}: no answer in {ANSWER_S:.0f} s"
                )
            return "hang", None
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
            return "connection_lost", None  # the server ending (SIGTERM) under it

    def _refusal(self, what: str, status: int, text: str, headers) -> str:
        try:
            code = json.loads(text)["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        if status == 429 and headers.get("retry-after"):
            return "rejected_429"
        if status == 503 and code == "recovering" and headers.get("retry-after"):
            return "recovering_503"
        self.tally.bad(what, status, text)
        return f"undocumented_{status}"

    # -- the clients -------------------------------------------------------------------------
    def client(self, k: int) -> None:
        import httpx

        r = random.Random(self.a.seed * 7919 + k)
        while time.monotonic() < self.stop_at:
            x = r.random()
            if x < 0.62:
                i = r.randrange(len(self.specs))
                stream = r.random() < 0.6
                cancel = r.randint(1, 3) if stream and r.random() < 0.15 else None
                outcome, text = self._complete(self.specs[i], stream, cancel, official=r.random() < 0.5)
                if outcome == "completed":
                    with self.tally.lock:
                        self.tally.checked += 1
                        if text == self.alone[i]:
                            self.tally.equal += 1
                        else:
                            self.tally.differ.append(f"request {i}: {text!r} alone {self.alone[i]!r}")
                self.tally.count(outcome)
                if outcome in ("rejected_429", "recovering_503"):
                    time.sleep(0.2)  # as a client that reads Retry-After would, in short
            else:
                act = self.documents if x < 0.75 else self.bad_input if x < 0.9 else self.burst
                try:
                    self.tally.count(act(r))
                except httpx.ReadTimeout:
                    with self.tally.lock:
                        self.tally.hangs.append(f"{act.__name__}: no answer in {ANSWER_S:.0f} s")
                    self.tally.count("hang")

    def documents(self, r: random.Random) -> str:
        """Documents API churn: post (pinned or not) a document, set its TTL, delete it (409 while in use)."""
        import httpx

        text = self.docs[r.randrange(3)] + f"\n\nNote {r.randrange(4)}."
        p = httpx.post(
            f"{self.url}/v1/documents",
            headers=self._auth(),
            timeout=httpx.Timeout(10.0, read=ANSWER_S),
            json={"text": text, "pin": r.random() < 0.3},
        )
        if p.status_code != 200:
            return self._expect("document post", p, (409, 503))
        key = p.json()["id"]
        t = httpx.patch(
            f"{self.url}/v1/documents/{key}",
            headers=self._auth(),
            json={"ttl_s": r.choice([5, 60])},
            timeout=httpx.Timeout(10.0, read=ANSWER_S),
        )
        if t.status_code not in (200, 404):
            return self._expect("document patch", t, (404, 503))
        d = httpx.delete(
            f"{self.url}/v1/documents/{key}", headers=self._auth(), timeout=httpx.Timeout(10.0, read=ANSWER_S)
        )
        return "documents_api" if d.status_code in (200, 404, 409) else self._expect("document delete", d, (503,))

    def _expect(self, what: str, r, documented: tuple) -> str:
        if r.status_code in (429, 503):  # back-pressure, new ranks starting: for any request
            return self._refusal(what, r.status_code, r.text, r.headers)
        if r.status_code in documented:
            return f"{what.split()[0]}_{r.status_code}"
        self.tally.bad(what, r.status_code, r.text)
        return f"undocumented_{r.status_code}"

    def bad_input(self, r: random.Random) -> str:
        """Malformed JSON (400), an oversized body (413), an unknown document (404), a bad field (400)."""
        import httpx

        kind = r.randrange(4)
        url, h = f"{self.url}/v1/completions", {**self._auth(), "content-type": "application/json"}
        t = httpx.Timeout(10.0, read=HANG_S)
        if kind == 0:
            resp, want = httpx.post(url, headers=h, content=b"{not json", timeout=t), 400
        elif kind == 1:
            resp, want = httpx.post(url, headers=h, content=b'{"prompt": "' + b"x" * 70000 + b'"}', timeout=t), 413
        elif kind == 2:
            resp, want = httpx.get(f"{self.url}/v1/documents/nosuchdocument", headers=self._auth(), timeout=t), 404
        else:
            resp, want = (
                httpx.post(url, headers=h, json={"model": self.name, "prompt": "hi", "max_tokens": -3}, timeout=t),
                400,
            )
        if resp.status_code == want:
            return f"bad_input_{want}"
        return self._expect("bad input", resp, ())

    def burst(self, r: random.Random) -> str:
        """Past ``--batch + --max-waiting`` at once: some get 429 with Retry-After; the rest complete."""
        outs: list = []
        threads = [
            threading.Thread(target=lambda i=i: outs.append(self._complete(self.specs[i], False)))
            for i in (r.randrange(len(self.specs)) for _ in range(10))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return "burst_429" if any(o == "rejected_429" for o, _ in outs) else "burst"

    # -- faults --------------------------------------------------------------------------------
    def fault(self, kind: str) -> str:
        t0 = time.monotonic()
        while self._health() != "ok" and time.monotonic() - t0 < 120:  # the previous fault recovered
            time.sleep(0.2)
        ranks = self.ranks()
        if not ranks:
            return f"{kind}: no rank found"
        victim = ranks[-1]
        if kind == "full":  # the cache directory's disk fills up: writes there fail, answers go on
            self.ballast = self.cache.parent / f".soak-ballast-{os.getpid()}"
            with open(self.ballast, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            return f"full: {self.ballast.stat().st_size >> 20} MiB of ballast, {self.cache.parent} full"
        if kind == "kill":  # then how soon service is back: /health ok again (new ranks, their model loaded)
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while self._health() == "ok" and time.monotonic() - t0 < 30:  # (until the server notices)
                time.sleep(0.05)
            while self._health() != "ok" and time.monotonic() - t0 < 300:
                time.sleep(0.1)
            self.back_s.append(round(time.monotonic() - t0, 1))
            return f"{kind}: rank pid {victim}, serving again after {self.back_s[-1]} s"
        elif kind == "stop":  # stopped until the others give up on it (a request in flight makes them wait)
            t0 = time.monotonic()
            self.stops.append((t0, t0 + self.read_s))  # (until it is noticed: below)
            os.kill(victim, signal.SIGSTOP)
            threading.Thread(target=self._complete, args=(self.specs[0], False), daemon=True).start()
            while self._health() == "ok" and time.monotonic() - t0 < 3 * self.a.timeout + 30:
                time.sleep(0.2)
            noticed = time.monotonic() - t0
            self.stops[-1] = (t0, t0 + noticed + STOP_GRACE_S)
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stop_noticed_s = noticed
            return f"{kind}: rank pid {victim}, noticed after {noticed:.1f} s"
        return f"{kind}: rank pid {victim}"

    def run(self) -> dict:
        self.start()
        self.catalogue()
        rss_start = self.rss()
        faults = [f for f in self.a.faults.split(",") if f in ("full", "kill", "stop")]
        done_faults = []
        self.stop_at = time.monotonic() + self.a.seconds
        clients = [threading.Thread(target=self.client, args=(k,), daemon=True) for k in range(self.a.clients)]
        for c in clients:
            c.start()
        for j, f in enumerate(faults):  # spread over the soak
            when = self.stop_at - self.a.seconds * (1 - (j + 1) / (len(faults) + 1))
            time.sleep(max(0.0, when - time.monotonic()))
            done_faults.append(self.fault(f))
        for c in clients:
            c.join(timeout=self.a.seconds + 2 * ANSWER_S)
        hung_clients = sum(c.is_alive() for c in clients)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:  # the event: healthy again after the last fault
            status = self._health()
            if status == "ok":
                break
            time.sleep(0.2)
        rss_end = self.rss()
        metrics, pinned = self._metrics(), self._pinned()
        leaked = self.leaked_blocks() if status == "ok" else None
        if self.ballast is not None:
            self.ballast.unlink(missing_ok=True)
        record = {
            "seconds": self.a.seconds,
            "clients": self.a.clients,
            "seed": self.a.seed,
            "outcomes": dict(sorted(self.tally.outcomes.items())),
            "checked": self.tally.checked,
            "equal": self.tally.equal,
            "differ": self.tally.differ[:5],
            "undocumented": self.tally.undocumented[:8],
            "hangs": self.tally.hangs[:5] + ([f"{hung_clients} client(s) never returned"] if hung_clients else []),
            "ttft_p50_s": _pct(self.tally.ttft, 0.5),
            "ttft_p99_s": _pct(self.tally.ttft, 0.99),
            "tpot_p50_s": _pct(self.tally.tpot, 0.5),
            "tpot_p99_s": _pct(self.tally.tpot, 0.99),
            "rank_peak_rss_mib_start": rss_start,
            "rank_peak_rss_mib_end": rss_end,
            "blocks_used_end": metrics.get("blocks_used"),
            "pinned_documents_end": pinned,
            "blocks_left_after_deleting_every_document": leaked,
            "restarts": metrics.get("restarts"),
            "faults": done_faults,
            "healthy_at_end": status == "ok",
            "stop_noticed_s": self.stop_noticed_s,
            "timeout_s": self.a.timeout,
            "back_after_kill_s": self.back_s,
            "server_start_s": self.start_s,
            "disk_full_warnings": (self.work / "server.log")
            .read_text(errors="replace")
            .count("cannot write to the cache directory"),
        }
        if "term" in self.a.faults.split(","):
            record["term"] = self.terminate()
        return record

    def _stopped_between(self, a: float, b: float) -> bool:
        """Whether a rank was stopped (the stop fault, until the server noticed) during [a, b]."""
        return any(s0 <= b and s1 >= a for s0, s1 in self.stops)

    def _health(self) -> str:
        import httpx

        try:
            r = httpx.get(f"{self.url}/health", timeout=5)
            return r.json().get("status", "?")
        except (httpx.HTTPError, ValueError):
            return "unreachable"

    def _metrics(self) -> dict:
        import httpx

        out = {"blocks_used": 0, "restarts": 0}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("treeattn_kv_blocks_used{"):
                out["blocks_used"] += int(float(line.split()[-1]))
            elif line.startswith("treeattn_rank_restarts_total "):
                out["restarts"] = int(float(line.split()[-1]))
        return out

    def leaked_blocks(self) -> int | None:
        """Blocks the ranks' pools still hold for documents once every document is deleted (pinned
        ones too) and one request without a document has run (the gauge is read as a batch ends):
        0 unless a block leaked. Run when the soak is over, before SIGTERM."""
        import httpx

        ids = [d["id"] for d in httpx.get(f"{self.url}/v1/documents", headers=self._auth(), timeout=30).json()["data"]]
        for key in ids:
            httpx.delete(f"{self.url}/v1/documents/{key}", headers=self._auth(), timeout=ANSWER_S)
        r = httpx.post(
            f"{self.url}/v1/completions",
            headers=self._auth(),
            timeout=ANSWER_S,
            json={"model": self.name, "prompt": "hi", "max_tokens": 1},
        )
        return self._metrics()["blocks_used"] if r.status_code == 200 else None

    def _pinned(self) -> int:
        import httpx

        data = httpx.get(f"{self.url}/v1/documents", headers=self._auth(), timeout=10).json()["data"]
        return sum(1 for d in data if d["pinned"])

    def terminate(self) -> dict:
        """SIGTERM with streams running: the server ends (143), its process tree gone."""
        tree = [self.proc.pid, *_descendants(self.proc.pid)]
        streams = [
            threading.Thread(target=self._complete, args=(self.specs[i % len(self.specs)], True), daemon=True)
            for i in range(3)
        ]
        for s in streams:
            s.start()
        time.sleep(0.5)
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "hung"
        # the tree ends with the server, its ranks a moment after: wait for that, not for a fixed time
        deadline = time.monotonic() + 15.0
        while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"exit": rc, "processes_left": left}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.ballast is not None:
            self.ballast.unlink(missing_ok=True)
        if self.a.cache_dir:
            import shutil

            shutil.rmtree(self.cache, ignore_errors=True)


def passed(rec: dict) -> bool:
    term = rec.get("term", {"exit": 143, "processes_left": []})
    stop = rec.get("stop_noticed_s")  # a stopped rank is lost within --timeout and the launcher's grace
    return (
        not rec["differ"]
        and not rec["undocumented"]
        and not rec["hangs"]
        and rec["checked"] > 0
        and (stop is None or stop <= rec["timeout_s"] + STOP_GRACE_S)
        and rec["checked"] == rec["equal"]
        and rec["healthy_at_end"]
        and rec.get("blocks_left_after_deleting_every_document", 0) == 0
        and term["exit"] in (143, -signal.SIGTERM)
        and not term["processes_left"]
    )


def table(rec: dict) -> str:
    lines = [
        f"soak: {rec['seconds']} s, {rec['clients']} clients, seed {rec['seed']}, faults: "
        f"{'; '.join(rec['faults']) or 'none'}"
    ]
    lines += [f"  {k:22} {v}" for k, v in rec["outcomes"].items()]
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f} ms"  # noqa: E731
    lines += [
        f"  answers checked {rec['checked']}, equal to alone {rec['equal']}",
        f"  first token p50 {ms(rec['ttft_p50_s'])}, p99 {ms(rec['ttft_p99_s'])}; per token p50 "
        f"{ms(rec['tpot_p50_s'])}, p99 {ms(rec['tpot_p99_s'])}",
        f"  rank peak RSS MiB at start {rec['rank_peak_rss_mib_start']}, at end {rec['rank_peak_rss_mib_end']}",
        f"  pool blocks in use at end {rec['blocks_used_end']} (pinned documents: {rec['pinned_documents_end']}); "
        f"after deleting every document {rec.get('blocks_left_after_deleting_every_document')}",
        f"  restarts {rec['restarts']}, hangs {len(rec['hangs'])}, healthy at end {rec['healthy_at_end']}, "
        f"disk-full warnings {rec.get('disk_full_warnings', 0)}, serving again after a kill in "
        f"{rec.get('back_after_kill_s') or '-'} s (the server started in {rec.get('server_start_s')} s)",
    ]
    if "term" in rec:
        lines.append(f"  SIGTERM: exit {rec['term']['exit']}, processes left {rec['term']['processes_left']}")
    for k in ("differ", "undocumented", "hangs"):
        lines += [f"  {k}: {x}" for x in rec[k]]
    lines.append("PASSED" if passed(rec) else "FAILED")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="treeattn serve under a soak with faults, every answer checked.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--catalogue", type=int, default=12, help="distinct requests (each recorded alone first)")
    ap.add_argument("--faults", default="kill,stop,term", help="comma-separated: full, kill, stop, term (or none)")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="where the server's cache directory goes (the full fault: a "
        "small filesystem of its own, e.g. a tmpfs of 256 MiB; default: a temporary folder)",
    )
    ap.add_argument("--timeout", type=float, default=10.0, help="the server's collective --timeout (stop's fault)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if "full" in a.faults.split(","):  # (never fill a disk others use)
        st = os.statvfs(a.cache_dir) if a.cache_dir and os.path.isdir(a.cache_dir) else None
        if st is None or st.f_blocks * st.f_frsize > 2 << 30:
            print(
                "treeattn soak: error: the full fault fills --cache-dir's filesystem: give --cache-dir on a small "
                "filesystem of its own (at most 2 GiB, e.g. mount -t tmpfs -o size=256m tmpfs DIR)",
                file=sys.stderr,
            )
            return 2
    soak = Soak(a)
    try:
        rec = soak.run()
    finally:
        soak.close()
    print(json.dumps(rec) if a.json else table(rec))
    return 0 if passed(rec) else 1


if __name__ == "__main__":
    sys.exit(main())
