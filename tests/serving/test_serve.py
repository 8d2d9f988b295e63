"""`treeattn serve`: a real server on a free loopback port (one per module, shared by the tests
that leave it serving; the SIGTERM test starts its own), used through the official `openai`
client and raw HTTP: answers equal `generate`, streaming, the document cache (in memory, and on
disk across a restart), concurrent clients joining a running batch, cancelled requests, bad
requests, auth, a lost rank, SIGTERM. Each test asks about its own document, so none depends on
what another cached; what the scheduler did (joins, cancels) is read from ``/health``'s stats."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import cli, descendants, rank_pids, still_running  # noqa: E402
from treeattn_cli.verify import tiny as tiny_models  # noqa: E402
import torch  # noqa: E402

TREEATTN = str(Path(sys.executable).with_name("treeattn"))
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
KEY = "sk-test-treeattn"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW = 8
LONG = 64  # tokens of an answer that is still running when others arrive
DOC = (
    "The ledger of the north bridge lists seven tolls, one for each day, and the keeper's notes on the "
    "flood of the ninth year, when the river rose over the second arch and the tolls were waived. "
) * 2


def _doc(test: str) -> str:
    """A document only the test ``test`` asks about (so no other test has cached it)."""
    return f"Copy kept for {test}. " + DOC


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model, cache_dir, port, *extra):
    """A server whose stderr goes to a file (``proc.log``): a pipe nobody reads would fill with
    its per-request lines and stop it."""
    log = Path(tempfile.mkstemp(prefix="treeattn-serve-", suffix=".log")[1])
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                TREEATTN,
                "serve",
                "--model",
                str(model),
                "--nproc",
                "2",
                "--dtype",
                "float32",
                "--port",
                str(port),
                "--api-key",
                KEY,
                "--cache-dir",
                str(cache_dir),
                "--batch",
                "4",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    proc.log = log
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:  # the event: /health answers
        assert proc.poll() is None, log.read_bytes().decode()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not come up")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    m = tiny_models.make_model("llama", root / "m", seed=3, max_position_embeddings=1024)
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    (m / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return m, root / "cache"


@pytest.fixture(scope="module")
def server(model):
    m, cache = model
    port = _free_port()
    proc = _start(m, cache, port)
    yield {
        "url": f"http://127.0.0.1:{port}",
        "proc": proc,
        "model": m,
        "cache": cache,
        "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0),
    }
    _stop(proc)


def _stop(proc) -> None:
    """SIGTERM (its ranks and fork server end with it), then SIGKILL if it does not end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    getattr(proc, "log", Path("/nonexistent")).unlink(missing_ok=True)  # (its stderr: read by then)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["stats"]


def _wait_stats(url: str, pred, timeout: float = 60.0) -> dict:
    """Poll ``/health`` until ``pred(stats)`` (the event a test waits for); the last stats."""
    t0 = time.monotonic()
    while True:
        st = _stats(url)
        if pred(st) or time.monotonic() - t0 > timeout:
            return st
        time.sleep(0.05)


def _generate(m, prompt, *flags):
    r = cli(
        "generate",
        "--model",
        str(m),
        "--prompt",
        prompt,
        "--nproc",
        "2",
        "--dtype",
        "float32",
        "--max-new-tokens",
        str(NEW),
        "--json",
        *flags,
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[-1])


def test_models_health_and_auth(server):
    url = server["url"]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and {"requests", "batches", "joined", "dropped", "answers"} <= set(health["stats"])
    ids = [m.id for m in server["client"].models.list()]
    assert ids == ["m"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    from treeattn_cli.cli.serve import bind_warning

    assert bind_warning("127.0.0.1", 8000, None) is None and bind_warning("0.0.0.0", 8000, "k") is None
    assert "without --api-key" in bind_warning("0.0.0.0", 8000, None)


def test_answers_equal_generate_and_the_document_is_cached(server):
    """A completion equals `generate --no-chat` on the same prompt, a chat completion equals
    `generate --chat`; the first question about a document prefills it (no cached tokens), the
    next ones continue its cache (cached tokens reported), with the same answers as alone."""
    c, m, doc = server["client"], server["model"], _doc("answers")
    prompt = doc + "\n\nWhich arch?"
    first = c.completions.create(model="m", prompt=prompt, max_tokens=NEW)
    assert first.choices[0].text == _generate(m, prompt, "--no-chat")["text"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(
        model="m", prompt=doc + "\n\nHow many tolls?", max_tokens=NEW, extra_body={"prompt_cache_retention": "24h"}
    )  # (OpenAI's: on disk here)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == _generate(m, doc + "\n\nHow many tolls?", "--no-chat")["text"]
    msg = doc + "\n\nWhat did the keeper note?"
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": msg}], max_tokens=NEW)
    assert chat.choices[0].message.content == _generate(m, msg, "--chat")["text"]
    assert chat.usage.completion_tokens == NEW and chat.choices[0].finish_reason == "length"


def test_cite_gives_the_citations_generate_gives(server):
    """``"cite": true`` (the official client's ``extra_body``): the message carries ``citations``
    with offsets into the last user message (its text at those offsets), the same sentences and
    shares as ``generate --cite`` of the same prompt (the server's cascade over the cached
    document against the single sequence's step); streamed, on the final chunk's delta; a
    completion, on its choice."""
    c, m, doc = server["client"], server["model"], _doc("cite")
    msg = doc + "\n\nWhat did the keeper note?"
    chat = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": msg}], max_tokens=NEW, extra_body={"cite": True}
    )
    got = chat.choices[0].message.model_extra["citations"]
    assert got and all(msg[x["start"] : x["end"]] == x["text"] and x["end"] <= len(doc) for x in got)
    assert chat.choices[0].message.model_extra["sentence_citations"] is not None
    want = {(x["start"], x["end"]): x["score"] for x in _generate(m, msg, "--chat", "--cite")["citations"]}
    common = [x for x in got if (x["start"], x["end"]) in want]
    assert len(common) >= min(3, len(want)) and all(
        abs(x["score"] - want[(x["start"], x["end"])]) < 1e-4 for x in common
    ), (got, want)
    stream = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": msg}], max_tokens=NEW, extra_body={"cite": True}, stream=True
    )
    last = [ch for ch in stream if ch.choices][-1]
    assert last.choices[0].finish_reason and last.choices[0].delta.model_extra["citations"] == got
    prompt = doc + "\n\nWhich arch?"
    comp = c.completions.create(model="m", prompt=prompt, max_tokens=NEW, extra_body={"cite": True})
    cits = comp.choices[0].model_extra["citations"]
    assert cits and all(prompt[x["start"] : x["end"]] == x["text"] for x in cits)


def test_a_document_that_extends_a_cached_one_takes_its_blocks(server):
    """A request whose document begins with a cached document and goes on (an appendix) is a
    document of its own: its prefill takes the cached one's blocks for their common segments
    (reported as cached tokens, fewer than the document) and prefills the rest; the answer is
    still `generate`'s."""
    c, m, doc = server["client"], server["model"], _doc("extends")
    first = c.completions.create(model="m", prompt=doc + "\n\nWhich arch?", max_tokens=NEW)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    longer = doc + "\n\nAppendix. " + DOC[::-1]
    prompt = longer + "\n\nWhich arch?"
    ext = c.completions.create(model="m", prompt=prompt, max_tokens=NEW)
    found = ext.usage.prompt_tokens_details.cached_tokens
    assert 0 < found < len(doc) and found % 2 == 0, found  # whole segments of 2 ranks, not the document
    assert ext.choices[0].text == _generate(m, prompt, "--no-chat")["text"]
    again = c.completions.create(model="m", prompt=longer + "\n\nHow many tolls?", max_tokens=NEW)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(longer)  # now a cached document itself


def test_streaming_and_stop_strings(server):
    c = server["client"]
    prompt = _doc("streaming") + "\n\nWhen did the river rise?"
    whole = c.completions.create(model="m", prompt=prompt, max_tokens=NEW).choices[0].text
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(model="m", prompt=prompt, max_tokens=NEW, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == whole and len(parts) > 1
    with httpx.stream(
        "POST",
        f"{server['url']}/v1/chat/completions",
        headers=AUTH,
        json={
            "model": "m",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": NEW,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] == NEW
    # the stop string is cut from this model's own answer, found above (so it occurs in it)
    assert len(whole) >= 4 and whole.strip(), repr(whole)
    stop = whole[2:4]
    cut = c.completions.create(model="m", prompt=prompt, max_tokens=NEW, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.find(stop)]


def _first_then_the_rest(c, prompts, sizes, timeout: float = 180) -> list[str]:
    """Stream ``prompts[0]``; once its first token has come, stream the others alongside it;
    each stream's text, in order."""
    got = [None] * len(prompts)
    began = threading.Event()

    def ask(i):
        parts = []
        for ch in c.completions.create(model="m", prompt=prompts[i], max_tokens=sizes[i], stream=True):
            if ch.choices:
                parts.append(ch.choices[0].text)
                began.set()
        got[i] = "".join(parts)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    threads[0].start()
    assert began.wait(120), "the first stream never began"
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return got


def test_concurrent_clients_get_the_answers_they_get_alone(server):
    """Six streams over one document: the first one long, the other five sent once its first
    token has come (so they find its batch running and join it: the stats say they did), equal
    the same requests one at a time."""
    c, url, doc = server["client"], server["url"], _doc("concurrent")
    prompts = [doc + f"\n\nQuestion {i}: which toll is {['first', 'last', 'highest'][i % 3]}?" for i in range(6)]
    sizes = [LONG] + [NEW] * 5
    alone = [c.completions.create(model="m", prompt=p, max_tokens=n).choices[0] for p, n in zip(prompts, sizes)]
    assert alone[0].finish_reason == "length", "the long answer must outlast the joiners' requests"
    before = _stats(url)
    got = _first_then_the_rest(c, prompts, sizes)
    assert got == [a.text for a in alone]
    after = _stats(url)
    assert after["joined"] - before["joined"] >= 1, (before, after)  # latecomers joined the running batch


def test_requests_about_other_documents_share_the_running_steps(server):
    """While one client streams a long answer about document A, a request about document B
    (cached) and one about a new document C join its batch: their rows share A's decode
    steps, C's document is prefilled between them (the stats say both happened), and every
    answer equals the same request alone."""
    c, url = server["client"], server["url"]
    words = DOC.split()
    docs = {"A": _doc("mixed A"), "B": " ".join(reversed(words)), "C": " ".join(words[1::2] + words[::2])}
    prompts = [docs["A"] + "\n\nTell all.", docs["B"] + "\n\nWhich toll is first?", docs["C"] + "\n\nWhich arch?"]
    sizes = [400, NEW, NEW]
    alone = [c.completions.create(model="m", prompt=p, max_tokens=n).choices[0] for p, n in zip(prompts[:2], sizes)]
    assert alone[0].finish_reason == "length", "the long answer must outlast the others"
    before = _stats(url)
    got = _first_then_the_rest(c, prompts, sizes)
    after = _stats(url)
    alone.append(c.completions.create(model="m", prompt=prompts[2], max_tokens=NEW).choices[0])  # C now cached
    assert got == [a.text for a in alone]
    assert after["mixed_batches"] > before["mixed_batches"], (before, after)
    assert after["segments_while_decoding"] > before["segments_while_decoding"], (before, after)


def test_a_client_that_leaves_cancels_its_request(server):
    """A client that leaves mid-answer: the engine ends that answer and frees its slot (the
    stats count it as cancelled), and the next request is answered."""
    c, url, doc = server["client"], server["url"], _doc("cancel")
    before = _stats(url)
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        headers=AUTH,
        json={"model": "m", "prompt": doc + "\n\nTell all.", "max_tokens": 400, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                break  # an answer has begun: leave
    after = _wait_stats(url, lambda st: st["answers"].get("cancelled", 0) > before["answers"].get("cancelled", 0))
    assert after["answers"].get("cancelled", 0) == before["answers"].get("cancelled", 0) + 1, (before, after)
    assert after["answers"].get("length", 0) == before["answers"].get("length", 0)  # it did not run to its end
    ok = c.completions.create(model="m", prompt=doc + "\n\nWhich arch?", max_tokens=NEW)
    assert ok.choices[0].text and ok.usage.completion_tokens == NEW


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": "m"}, 400, "'messages'"),
        ({"model": "m", "messages": "hi"}, 400, "'messages'"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "'n'"),
        ({"model": "m", "messages": [{"role": "user", "content": "x" * 1100}]}, 400, "maximum context length"),
        ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cite": "yes"},
            400,
            "'cite' must be a boolean",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "cite": True}, 400, "needs a document part"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_retention": "1w"},
            400,
            "'prompt_cache_retention' must be",
        ),
    ],
)
def test_bad_requests_get_an_error_object_and_the_server_keeps_serving(server, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server['url']}/v1/chat/completions", content=data, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"message", "type", "param", "code"} <= set(err)
    assert httpx.get(f"{server['url']}/health").status_code == 200


def test_sigterm_then_a_restart_keeps_the_documents_and_lost_ranks_come_back(model, tmp_path):
    """A server of its own: SIGTERM during a request (its document being prefilled, or its answer
    streaming): the stream ends with its [DONE] within
    seconds (docs/serving.md's promise; bound here at a generous 30 s for a loaded 2-core machine) and
    the process tree is gone. A new server on the same --cache-dir continues the saved document
    on its first request. A rank killed outright mid-answer: that stream ends with the reason, the
    server starts new ranks by itself (503 ``recovering`` meanwhile), counts the restart and
    answers again over the saved document, from disk. Ranks that cannot come back (the model's
    files gone): the server stops, exit 1, with one line that says why."""
    m, _ = model
    cache, doc = tmp_path / "cache", _doc("sigterm")
    port = _free_port()
    proc = _start(m, cache, port)
    url = f"http://127.0.0.1:{port}"
    try:
        tree = descendants(proc.pid)
        c1 = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        c1.completions.create(model="m", prompt=doc + "\n\nWhich toll?", max_tokens=2)  # the document, saved
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            headers=AUTH,
            timeout=60,
            json={"model": "m", "prompt": _doc("sigterm, new") + "\n\nTell all.", "max_tokens": 400, "stream": True},
        ) as r:
            lines = r.iter_lines()
            # the stream's first chunk comes at once: the signal lands while the new document is
            # prefilled or while it is answered, and either way the stream ends with its [DONE]
            next(x for x in lines if x.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = [x for x in lines if x]
        assert time.monotonic() - t0 < 30 and rest[-1] == "data: [DONE]", rest[-3:]
        assert proc.wait(timeout=60) in (-signal.SIGTERM, 143)  # ended by the signal, as other tools are
        assert not still_running(tree, within=30), tree
    finally:
        _stop(proc)
    port = _free_port()
    mine = tmp_path / "copy" / "m"  # the model's files (served as "m"), which the last part takes away
    shutil.copytree(m, mine)
    proc2 = _start(mine, cache, port, "--restarts", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        c2 = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        first = c2.completions.create(model="m", prompt=doc + "\n\nHow many tolls?", max_tokens=NEW)
        assert first.usage.prompt_tokens_details.cached_tokens > 0  # from disk, not prefilled again
        ranks = rank_pids(proc2.pid)
        assert len(ranks) == 2, ranks
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            headers=AUTH,
            timeout=120,
            json={"model": "m", "prompt": doc + "\n\nTell all.", "max_tokens": 400, "stream": True},
        ) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: {") and '"text": "' in x)  # answering
            os.kill(ranks[1], signal.SIGKILL)
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and "rank" in rest[-2], rest[-3:]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:  # the event: /health is 200 again, the restart counted
            h = httpx.get(f"{url}/health")
            if h.status_code == 200 and _metrics(url)[("treeattn_rank_restarts_total", ())] == 1:
                break
            if h.status_code != 200:  # (200 before: the loss not noticed yet)
                assert h.json()["status"] == "recovering" and "rank" in h.json()["reason"], h.text
                r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"model": "m", "prompt": "hi"})
                assert r.status_code == 200 or (
                    r.status_code == 503
                    and r.json()["error"]["code"] == "recovering"
                    and r.headers["retry-after"] == "5"
                ), r.text  # (200: back since)
            time.sleep(0.1)
        assert h.status_code == 200, h.text
        assert "starting the ranks again" in proc2.log.read_text() and len(rank_pids(proc2.pid)) == 2
        again = c2.completions.create(model="m", prompt=doc + "\n\nHow many tolls?", max_tokens=NEW)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the document from disk, in the new ranks
        shutil.rmtree(mine)  # ranks that cannot come back: one line, exit 1
        os.kill(rank_pids(proc2.pid)[0], signal.SIGKILL)
        assert proc2.wait(timeout=120) == 1
        err = [x for x in proc2.log.read_text().splitlines() if x.startswith("treeattn serve: error:")]
        assert len(err) == 1 and "did not come back after 1 try (--restarts)" in err[0], proc2.log.read_text()[-3000:]
    finally:
        _stop(proc2)


def test_saved_documents_of_another_kv_dtype_are_named_at_start(tmp_path):
    """A --cache-dir holding documents saved with another KV storage: the server says at start,
    in one line per storage, how many are converted as they load (no server needed)."""
    from treeattn_cli.serving.catalog import Catalog, Entry

    index = Catalog(tmp_path)
    index.entries = {
        "a": Entry([], on_disk=True, manifest={"kv_dtype": "fp8_e4m3fn", "dtype": "float32"}),
        "b": Entry([], on_disk=True, manifest={"kv_dtype": "fp8_e4m3fn", "dtype": "float32"}),
        "c": Entry([], on_disk=True, manifest={"dtype": "float32"}),
    }  # saved before fp8 KV
    lines = index.conversions("float32")
    assert len(lines) == 1 and lines[0].startswith(f"2 saved document(s) in {tmp_path}: ")
    assert "fp8_e4m3fn" in lines[0] and "dequantized" in lines[0]
    assert index.conversions("fp8_e4m3fn")[0].startswith("1 saved document(s)")
    assert "rounded to fp8 (lossy)" in index.conversions("fp8_e4m3fn")[0]


def test_a_document_that_cannot_fit_even_alone_is_refused_with_the_numbers():
    """The admission rule behind HTTP 400 ``document_too_large``, counted engine-side
    (``engine.room.PoolRoom``) from tokens: a document part whose KV per rank exceeds
    --kv-memory is refused with its size and the limit; one that fits alone is taken (others
    leave memory first)."""
    from treeattn_cli.engine.room import PoolRoom

    per_token = 131072  # Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes

    def alone(tokens, nproc, tp):
        return PoolRoom(cp=nproc // tp, tp=tp, bytes_per_token=per_token, pool_bytes=8 << 30).alone(tokens)

    assert alone(1_000_000, 8, 1) == (
        "the document part of this request (1000000 tokens) needs 15625.0 MiB of KV "
        "cache per rank; this server keeps at most 8192.0 MiB per rank (--kv-memory)"
    )
    assert alone(500_000, 8, 1) is None  # 7.6 GiB per rank
    assert alone(1_000_000, 16, 2) is None  # tp splits heads
    assert alone(1_000_000, 4, 1) is not None


def test_a_request_and_a_pin_are_counted_in_the_pools_blocks_beside_the_pinned_documents():
    """``PoolRoom.request`` and ``PoolRoom.pin`` count what the ranks' pools hold: a document's
    even share in blocks, its question and answer as the batch's tail takes them, beside the
    pinned documents; the block count is the ranks' own once reported, else what the bytes hold
    (as ``Documents.make_pool`` sizes it)."""
    from treeattn_cli.engine.room import PAGE, blocks_in
    from treeattn_cli.engine.room import PoolRoom

    per_token = 2 * 30 * 3 * 64 * 4  # the embedded model in fp32, 2 ranks: both ranks' bytes
    room = PoolRoom(cp=2, tp=1, bytes_per_token=per_token, pool_bytes=64 << 20)
    assert room.blocks == blocks_in(64 << 20, per_token) == (64 << 20) // (PAGE * per_token + 8 * PAGE)
    room = PoolRoom(cp=2, tp=1, bytes_per_token=per_token, pool_bytes=64 << 20, reported=20)
    assert room.blocks == 20 and room.document(1280) == 10 and room.document(1281) == 11
    assert room.request(1280, 120) is None  # 10 + a tail of 60 tokens here: 2 blocks (even share + 1)
    assert room.request(1280, 0, pinned=[1280]) is None  # 10 + 10 of 20
    line = room.request(1280, 120, pinned=[1280])
    assert line == (
        "this request needs 12 blocks of the KV pool per rank (its document part (1280 tokens) 10, its "
        "question and answer (120 tokens) 2); pinned documents hold 10 of its 20 (unpin or delete "
        "some: /v1/documents)"
    )
    assert room.request(0, 2600) == (
        "this request needs 22 blocks of the KV pool per rank (its question and answer "
        "(2600 tokens) 22); the pool holds 20 per rank (--kv-memory)"
    )
    assert room.pin(1280, [], 0.75) is None and room.pin(1280, [640], 0.75) is None  # 10 + 5 of 15
    refusal = room.pin(1281, [640], 0.75)
    assert (
        refusal.startswith("pinning this document (1281 tokens: 11 blocks per rank, ")
        and "needs 16 blocks per rank; pinned documents may hold 15 of the pool's 20 (75% of the KV pool's 64.0 MiB"
        in refusal
    ), refusal
    # the server's admission asks it (the engine front's catalogue): a short document part is
    # question, a resident one needs no room
    from treeattn_cli.serving.catalog import MIN_DOCUMENT, Catalog, Entry

    known = list(range(1280))
    catalog = Catalog(None, room)
    catalog.entries = {"k": Entry(known, resident=True), "p": Entry(list(range(5000, 6280)), pinned=True)}
    new = list(range(7000, 8290))
    assert catalog.too_large(1280, new, tail_tokens=120) == line
    assert catalog.too_large(1280, known + [1, 2], tail_tokens=120) is None  # resident: its tail alone
    assert "its question and answer (1300 tokens) 12" in catalog.too_large(1280, known + [1, 2], tail_tokens=1300)
    assert catalog.too_large(MIN_DOCUMENT - 1, new, tail_tokens=120) is None


@pytest.mark.parametrize(
    "text,want",
    [
        ("8GiB", (8 << 30, None)),
        ("512MiB", (512 << 20, None)),
        ("1.5G", (1_500_000_000, None)),
        ("2000000000", (2_000_000_000, None)),
        ("0.9", (None, 0.9)),
        ("90%", (None, 0.9)),
        ("1.0", (None, 1.0)),
    ],
)
def test_kv_memory_is_a_size_or_a_fraction(text, want):
    from treeattn_cli.cli.options import parse_memory

    assert parse_memory(text) == want


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--kv-memory", "lots"], "--kv-memory must be a size"),
        (["--kv-memory", "150%"], "--kv-memory must be a size"),
        (["--kv-memory", "0.0"], "--kv-memory must be a size"),
        (["--kv-memory", "4096"], "at least 1 MiB"),
        (["--kv-memory", "1GiB", "--cache-bytes", "1048576"], "older name"),
        (["--host-memory", "0.5"], "--host-memory must be a size"),
        (["--host-memory", "lots"], "--host-memory must be a size"),
        (["--cache-dir", "FILE"], "not a directory"),
        (["--cache-dir", "/proc/treeattn-nope/x"], "cannot be made"),
    ],
)
def test_a_bad_kv_memory_is_one_line_before_anything_starts(model, extra, needle, tmp_path):
    from helpers import assert_usage_error

    (tmp_path / "f").write_text("x")
    extra = [str(tmp_path / "f") if x == "FILE" else x for x in extra]
    assert_usage_error(cli("serve", "--model", str(model[0]), *extra), needle)


def _metrics(url) -> dict:
    """``GET /metrics`` parsed: ``{(name, labels as sorted tuple): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:200]
    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(r.text)
        for smp in fam.samples
    }


def test_every_request_is_counted_in_the_metrics_and_logged_on_one_line(server):
    """Two requests, one streamed and one not: /metrics (Prometheus text, prometheus-client)
    counts both by outcome, their prompt, cached and generated tokens, observes their first
    token, every gap between tokens and their whole latency, shows each rank's KV pool; the
    server's stderr has one line per request with its id, document, tokens and status."""
    c, url, doc = server["client"], server["url"], _doc("metrics")
    before = _metrics(url)
    first = c.completions.create(model="m", prompt=doc + "\n\nWhich arch?", max_tokens=NEW)
    chunks = list(
        c.completions.create(
            model="m", prompt=doc + "\n\nWhy?", max_tokens=NEW, stream=True, stream_options={"include_usage": True}
        )
    )  # the same document: cached
    usage = chunks[-1].usage
    after = _metrics(url)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("treeattn_requests_total", outcome="length") == 2
    assert grew("treeattn_prompt_tokens_total") == first.usage.prompt_tokens + usage.prompt_tokens
    assert grew("treeattn_generation_tokens_total") == 2 * NEW
    cached = first.usage.prompt_tokens_details.cached_tokens + usage.prompt_tokens_details.cached_tokens
    assert grew("treeattn_cached_prompt_tokens_total") == cached > 0
    assert grew("treeattn_time_to_first_token_seconds_count") == 2
    assert grew("treeattn_e2e_request_latency_seconds_count") == 2
    assert grew("treeattn_time_per_output_token_seconds_count") == 2 * (NEW - 1)
    for rank in ("0", "1"):
        assert after[("treeattn_kv_blocks_total", (("rank", rank),))] > 0
        assert (
            0
            < after[("treeattn_kv_blocks_used", (("rank", rank),))]
            <= after[("treeattn_kv_blocks_total", (("rank", rank),))]
        )
    assert after[("treeattn_requests_running", ())] == 0 and after[("treeattn_requests_waiting", ())] == 0
    assert after[("treeattn_documents_resident", ())] >= 1
    lines = [x for x in server["proc"].log.read_text().splitlines() if x.startswith("treeattn: request ")]
    mine = [x for x in lines if f"id={first.id} " in x]
    assert len(mine) == 1, lines[-5:]
    assert f"prompt_tokens={first.usage.prompt_tokens} " in mine[0] and f"generated_tokens={NEW} " in mine[0]
    assert "status=length" in mine[0] and "document=" in mine[0] and "ttft_s=" in mine[0]


def test_past_the_waiting_limit_a_request_gets_429_at_once_and_the_others_go_on(model, tmp_path):
    """A server of its own, --batch 1 --max-waiting 1, JSON log lines: while one answer streams
    and one request waits, a third gets 429 with Retry-After and an OpenAI error object at once;
    a body over --max-request-bytes gets 413; the two taken requests still end well; each is one
    JSON line on stderr, the refused ones too. Its pool is 1 MiB: documents pinned past 3/4 of
    it are refused with 409 (and kept, unpinned), and pinned ones stay resident whatever comes
    and answer from the cache; one of them was pinned by --document --pin before the server
    listened. A document a running request reads cannot be deleted (409)."""
    m, _ = model
    port = _free_port()
    start_doc = tmp_path / "contract.txt"
    start_doc.write_text(_doc("pinned at start"))
    proc = _start(
        m,
        tmp_path / "cache",
        port,
        "--batch",
        "1",
        "--max-waiting",
        "1",
        "--max-request-bytes",
        "8192",
        "--log-format",
        "json",
        "--kv-memory",
        "1MiB",
        "--document",
        str(start_doc),
        "--pin",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        first = httpx.get(f"{url}/v1/documents", headers=AUTH).json()["data"]
        assert len(first) == 1 and first[0]["pinned"] and first[0]["resident"], first
        # the pool was made at start, of --kv-memory: as many blocks as 1 MiB holds, on both ranks
        from treeattn_cli.engine.pool import BlockPool

        cfg = json.loads((m / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        per = BlockPool.bytes_per_block(
            cfg["num_hidden_layers"],
            cfg.get("num_key_value_heads", heads),
            cfg["hidden_size"] // heads,
            64,
            torch.float32,
        )
        blocks = (1 << 20) // per
        assert (
            f"[KV pool: {blocks:,} blocks of 64 tokens per rank, {blocks * per / 2**20:,.1f} MiB "
            "(--kv-memory 1MiB); host tier " in proc.log.read_text()
        ), proc.log.read_text()[-2000:]
        for _ in range(4):  # refused after admission: each gives its place back
            bad = httpx.post(f"{url}/v1/completions", headers=AUTH, content=b"{not json")
            assert bad.status_code == 400, bad.text
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        doc = _doc("back-pressure")
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            headers=AUTH,
            timeout=120,
            json={"model": "m", "prompt": doc + "\n\nTell all.", "max_tokens": 400, "stream": True},
        ) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: {") and '"text": ""' not in x)  # answering now
            waiting = {}
            t = threading.Thread(
                target=lambda: waiting.setdefault(
                    "r", c.completions.create(model="m", prompt=doc + "\n\nWhich toll?", max_tokens=2)
                )
            )
            t.start()
            t0 = time.monotonic()
            while _metrics(url).get(("treeattn_requests_waiting", ())) != 1:  # the event: it waits
                assert time.monotonic() - t0 < 60 and t.is_alive()
                time.sleep(0.05)
            t1 = time.monotonic()
            refused = httpx.post(
                f"{url}/v1/completions",
                headers=AUTH,
                timeout=30,
                json={"model": "m", "prompt": "hello there", "max_tokens": 2},
            )
            assert time.monotonic() - t1 < 10  # at once, not after the answers under way
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            err = refused.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "--max-waiting" in err["message"]
            big = httpx.post(
                f"{url}/v1/completions",
                headers=AUTH,
                timeout=30,
                json={"model": "m", "prompt": "x" * 9000, "max_tokens": 2},
            )
            assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large", big.text
            streaming = [
                d["id"]
                for d in httpx.get(f"{url}/v1/documents", headers=AUTH).json()["data"]
                if d["id"] != first[0]["id"]
            ]
            assert len(streaming) == 1
            busy = httpx.delete(f"{url}/v1/documents/{streaming[0]}", headers=AUTH)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "document_in_use", busy.text
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        t.join(60)
        assert waiting["r"].choices[0].finish_reason == "length"
        after = _metrics(url)
        assert after[("treeattn_requests_total", (("outcome", "rejected"),))] == 1
        assert after[("treeattn_requests_total", (("outcome", "too_large"),))] == 1
        recs = [json.loads(x) for x in proc.log.read_text().splitlines() if x.startswith("{")]
        assert sorted(r["status"] for r in recs) == ["length", "length", "rejected", "too_large"], recs
        # pinned documents may fill the 1 MiB pool, not more: the pin past it is refused (409)
        pinned, refused = [], None
        for i in range(16):
            r = httpx.post(
                f"{url}/v1/documents", headers=AUTH, timeout=120, json={"text": f"Part {i}. " + DOC * 2, "pin": True}
            )
            if r.status_code == 409:
                refused = r.json()["error"]
                break
            assert r.status_code == 200, r.text
            pinned.append(r.json())
        assert refused is not None and refused["code"] == "pin_exceeds_pool" and "--kv-memory" in refused["message"]
        pinned += first
        assert len(pinned) > 1 and sum(d["bytes"] for d in pinned) <= 0.75 * (1 << 20)
        listed = httpx.get(f"{url}/v1/documents", headers=AUTH).json()["data"]
        assert sum(d["pinned"] for d in listed) == len(pinned)
        assert any(d["id"] not in {p["id"] for p in pinned} and d["resident"] and not d["pinned"] for d in listed)
        # pinned documents stay: a request over a new one evicts others, never them
        c.completions.create(model="m", prompt="Another. " + DOC * 2 + "\n\nWhich arch?", max_tokens=2)
        listed = {d["id"]: d for d in httpx.get(f"{url}/v1/documents", headers=AUTH).json()["data"]}
        assert all(listed[p["id"]]["resident"] and listed[p["id"]]["pinned"] for p in pinned)
        chat = c.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": _doc("pinned at start") + "\n\nWhich arch?"}]
        )
        assert chat.usage.prompt_tokens_details.cached_tokens == first[0]["tokens"]  # answered from the cache
        assert all(
            {"id", "document", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "status"} <= set(r)
            for r in recs
        )
        # a document the pool gave up kept a copy in the host tier (issue 52): asked again, copied
        # back (the answer's document tokens all cached), not prefilled
        gone = listed[streaming[0]]
        assert not gone["resident"] and gone["tier"] == "host" and gone["host"] and gone["on_disk"], gone
        hosted = _metrics(url).get(("treeattn_documents_made_total", (("tier", "host"),)), 0)
        back = c.completions.create(model="m", prompt=doc + "\n\nWhich toll?", max_tokens=2)
        assert back.usage.prompt_tokens_details.cached_tokens == gone["tokens"], back.usage
        assert _metrics(url)[("treeattn_documents_made_total", (("tier", "host"),))] == hosted + 1
        now = httpx.get(f"{url}/v1/documents/{gone['id']}", headers=AUTH).json()
        assert now["resident"] and now["tier"] == "device" and not now["host"], now
    finally:
        _stop(proc)


def test_the_documents_api_posts_pins_lists_and_deletes(server):
    """POST /v1/documents prefills a document that a chat request beginning with its text then
    finds cached; GET lists it (posted or made by requests) and one by id; PATCH unpins and sets
    a TTL; a document whose TTL runs out leaves memory (its saved copy stays); DELETE frees it
    (the next request prefills again) and a second DELETE is 404; bad bodies get 400, unknown
    ids 404, requests without the key 401."""
    url, c = server["url"], server["client"]
    text = _doc("documents api")
    r = httpx.post(f"{url}/v1/documents", headers=AUTH, json={"text": text, "pin": True}, timeout=120)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "document" and d["pinned"] and d["resident"] and d["tokens"] > len(text) // 2
    chat = c.chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": text + "\n\nWhich arch?"}]
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == d["tokens"]
    listed = httpx.get(f"{url}/v1/documents", headers=AUTH).json()
    mine = [x for x in listed["data"] if x["id"] == d["id"]]
    assert listed["object"] == "list" and len(mine) == 1 and mine[0]["hits"] >= 1 and mine[0]["bytes"] > 0
    assert httpx.get(f"{url}/v1/documents/{d['id']}", headers=AUTH).json()["pinned"]
    p = httpx.patch(f"{url}/v1/documents/{d['id']}", headers=AUTH, json={"pin": False, "ttl_s": 3600}).json()
    assert not p["pinned"] and p["ttl_s"] == 3600 and p["resident"]
    for bad, why in (
        ({"text": ""}, "text"),
        ({"text": text, "pin": "yes"}, "pin"),
        ({"text": text, "ttl_s": -1}, "ttl_s"),
        ({"text": text, "colour": 1}, "colour"),
        ({"text": "too short"}, "text"),
    ):
        r = httpx.post(f"{url}/v1/documents", headers=AUTH, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == why, (bad, r.text)
    assert httpx.get(f"{url}/v1/documents/nope", headers=AUTH).status_code == 404
    for escape, code in (("%2E%2E", "document_not_found"), ("..%2F..%2Fetc%2Fpasswd", "not_found")):
        for verb in (httpx.get, httpx.delete):  # ids are keys, never paths: unknown (or no such route)
            r = verb(f"{url}/v1/documents/{escape}", headers=AUTH)
            assert r.status_code == 404 and r.json()["error"]["code"] == code, (escape, r.text)
    assert httpx.get(f"{url}/v1/documents", headers={}).status_code == 401
    short = httpx.post(
        f"{url}/v1/documents", headers=AUTH, timeout=120, json={"text": _doc("documents api, ttl"), "ttl_s": 0.5}
    ).json()
    assert short["resident"] and short["ttl_s"] == 0.5
    t0 = time.monotonic()
    while httpx.get(f"{url}/v1/documents/{short['id']}", headers=AUTH).json()["resident"]:  # the event: it left
        assert time.monotonic() - t0 < 60, "the TTL never evicted it"
        time.sleep(0.2)
    left = httpx.get(f"{url}/v1/documents/{short['id']}", headers=AUTH).json()
    assert left["on_disk"] and left["tier"] == "disk" and not left["host"], left  # saved: it comes back (a TTL
    # is the time in memory: the host tier's copy leaves too)
    gone = httpx.delete(f"{url}/v1/documents/{d['id']}", headers=AUTH)
    assert gone.status_code == 200 and gone.json()["deleted"], gone.text
    assert httpx.delete(f"{url}/v1/documents/{d['id']}", headers=AUTH).status_code == 404
    again = c.chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": text + "\n\nWhich arch?"}]
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # deleted: its blocks and saved copy too


def test_a_request_to_a_front_that_stopped_fails_at_once():
    """The engine's front after shutdown (or a failure): a request, and a documents-API request,
    end at once with ``Failed`` (nothing would take them: they must not wait for ever). No ranks."""
    from treeattn_cli.engine.requests import Ask, Failed
    from treeattn_cli.serving.catalog import Catalog
    from treeattn_cli.serving.front import BatchOptions, EngineFront

    front = EngineFront(None, Catalog(None), BatchOptions(slots=1, pool_bytes=0), read_manifest=None)
    front.start()
    front.shutdown()
    front.join(5)
    assert not front.is_alive()
    got = []
    front.submit(Ask([1, 2, 3], 4), 0, got.append)
    assert len(got) == 1 and isinstance(got[0], Failed) and "shutting down" in got[0].reason, got
    with pytest.raises(RuntimeError, match="cannot take documents"):
        front.document("k", list(range(40)), {})
