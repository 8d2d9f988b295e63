"""`treeattn serve`: a real server on a free loopback port (started once per group of tests),
used through the official `openai` client and raw HTTP: answers equal `generate`, streaming,
the document cache (in memory, and on disk across a restart), concurrent clients, cancelled
requests, bad requests, auth, a lost rank, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import cli  # noqa: E402
from test_reliability import _descendants, _gone, _ranks  # noqa: E402
from treeattn_cli.verify import tiny as tiny_models  # noqa: E402

TREEATTN = str(Path(sys.executable).with_name("treeattn"))
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEY = "sk-test-treeattn"
NEW = 8
DOC = ("The ledger of the north bridge lists seven tolls, one for each day, and the keeper's notes on the "
       "flood of the ninth year, when the river rose over the second arch and the tolls were waived. ") * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model, cache_dir, port, *extra):
    proc = subprocess.Popen([TREEATTN, "serve", "--model", str(model), "--nproc", "2", "--dtype", "float32",
                             "--port", str(port), "--api-key", KEY, "--cache-dir", str(cache_dir), "--batch", "4",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:  # the event: /health answers
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
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
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "model": m, "cache": cache,
           "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _generate(m, prompt, *flags):
    r = cli("generate", "--model", str(m), "--prompt", prompt, "--nproc", "2", "--dtype", "float32",
            "--max-new-tokens", str(NEW), "--json", *flags)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[-1])


def test_models_health_and_auth(server):
    url = server["url"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
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
    c, m = server["client"], server["model"]
    prompt = DOC + "\n\nWhich arch?"
    first = c.completions.create(model="m", prompt=prompt, max_tokens=NEW)
    assert first.choices[0].text == _generate(m, prompt, "--no-chat")["text"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model="m", prompt=DOC + "\n\nHow many tolls?", max_tokens=NEW)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == _generate(m, DOC + "\n\nHow many tolls?", "--no-chat")["text"]
    msg = DOC + "\n\nWhat did the keeper note?"
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": msg}], max_tokens=NEW)
    assert chat.choices[0].message.content == _generate(m, msg, "--chat")["text"]
    assert chat.usage.completion_tokens == NEW and chat.choices[0].finish_reason == "length"


def test_streaming_and_stop_strings(server):
    c = server["client"]
    prompt = DOC + "\n\nWhen did the river rise?"
    whole = c.completions.create(model="m", prompt=prompt, max_tokens=NEW).choices[0].text
    parts = [ch.choices[0].text for ch in c.completions.create(model="m", prompt=prompt, max_tokens=NEW, stream=True)
             if ch.choices]
    assert "".join(parts) == whole and len(parts) > 1
    with httpx.stream("POST", f"{server['url']}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": NEW,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] == NEW
    stop = whole[2:4]
    cut = c.completions.create(model="m", prompt=prompt, max_tokens=NEW, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.find(stop)]


def test_concurrent_clients_get_the_answers_they_get_alone(server):
    """Six streams at once (they decode together over the shared document, latecomers joining
    the running batch) equal the same requests one at a time."""
    c = server["client"]
    prompts = [DOC + f"\n\nQuestion {i}: which toll is {['first', 'last', 'highest'][i % 3]}?" for i in range(6)]
    alone = [c.completions.create(model="m", prompt=p, max_tokens=NEW).choices[0].text for p in prompts]
    got = [None] * 6

    def ask(i):
        got[i] = "".join(ch.choices[0].text for ch in
                         c.completions.create(model="m", prompt=prompts[i], max_tokens=NEW, stream=True) if ch.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == alone


def test_a_client_that_leaves_cancels_its_request(server):
    c = server["client"]
    with httpx.stream("POST", f"{server['url']}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "m", "prompt": DOC + "\n\nTell all.", "max_tokens": 400, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                break  # an answer has begun: leave
    t0 = time.monotonic()
    ok = c.completions.create(model="m", prompt=DOC + "\n\nWhich arch?", max_tokens=NEW)
    assert ok.choices[0].text and time.monotonic() - t0 < 60


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "m"}, 400, "'messages'"),
    ({"model": "m", "messages": "hi"}, 400, "'messages'"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "'n'"),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 1100}]}, 400, "maximum context length"),
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
])
def test_bad_requests_get_an_error_object_and_the_server_keeps_serving(server, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server['url']}/v1/chat/completions", content=data,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"message", "type", "param", "code"} <= set(err)
    assert httpx.get(f"{server['url']}/health").status_code == 200


def test_sigterm_then_a_restart_keeps_the_documents_and_a_lost_rank_is_503(server, model):
    """SIGTERM during an answer: the stream ends within seconds, the process tree is gone. A new
    server on the same --cache-dir continues the saved document on its first request. A rank
    killed outright: /health and requests turn 503 with the reason."""
    proc = server["proc"]
    tree = _descendants(proc.pid)
    with httpx.stream("POST", f"{server['url']}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "m", "prompt": DOC + "\n\nTell all.", "max_tokens": 400, "stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rest = [x for x in lines if x]
    assert time.monotonic() - t0 < 15 and rest[-1] == "data: [DONE]", rest[-3:]
    assert proc.wait(timeout=30) in (-signal.SIGTERM, 143)  # ended by the signal, as other tools are
    assert not _gone(tree), tree
    m, cache = model
    port = _free_port()
    proc2 = _start(m, cache, port)
    try:
        c2 = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        first = c2.completions.create(model="m", prompt=DOC + "\n\nHow many tolls?", max_tokens=NEW)
        assert first.usage.prompt_tokens_details.cached_tokens > 0  # from disk, not prefilled again
        ranks = _ranks(proc2.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            h = httpx.get(f"http://127.0.0.1:{port}/health")
            if h.status_code == 503:
                break
            time.sleep(0.2)
        assert h.status_code == 503 and "rank" in h.json()["reason"], h.text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(timeout=30)


def test_saved_documents_of_another_kv_dtype_are_named_at_start(tmp_path):
    """A --cache-dir holding documents saved with another KV storage: the server says at start,
    in one line per storage, how many are converted as they load (no server needed)."""
    from treeattn_cli.cli.serve import DocIndex

    index = DocIndex(tmp_path)
    index.entries = {"a": {"manifest": {"kv_dtype": "fp8_e4m3fn", "dtype": "float32"}},
                     "b": {"manifest": {"kv_dtype": "fp8_e4m3fn", "dtype": "float32"}},
                     "c": {"manifest": {"dtype": "float32"}}}  # saved before fp8 KV: the model's dtype
    lines = index.conversions("float32")
    assert len(lines) == 1 and lines[0].startswith(f"2 saved document(s) in {tmp_path}: ")
    assert "fp8_e4m3fn" in lines[0] and "dequantized" in lines[0]
    assert index.conversions("fp8_e4m3fn")[0].startswith("1 saved document(s)")
    assert "rounded to fp8 (lossy)" in index.conversions("fp8_e4m3fn")[0]
