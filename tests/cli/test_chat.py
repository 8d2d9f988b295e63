"""`treeattn chat`: a document prefilled once, many questions, saved and loaded caches.

Every answer is compared with transformers' greedy decode on the same tokens (the document's,
then the question's), so reusing the cache never changes an answer."""

from __future__ import annotations

import json
import os
import re
import pty
import select
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treeattn_cli.cli import prompt as P
from treeattn_cli.verify import tiny as tiny_models
from treeattn_cli.main import app
from treeattn_cli.model.load import load_tokenizer
from helpers import assert_usage_error, descendants, kernel_view, rank_pids

TREEATTN = str(Path(sys.executable).with_name("treeattn"))
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUESTIONS = ["what comes first?", "and then", "name the last word"]
NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = tiny_models.make_model("llama", root / "m", seed=3)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    doc = root / "doc.txt"
    doc.write_text("the archive lists seven towers, a bridge of iron, and two clocks that never agree. " * 3)
    qs = root / "questions.txt"
    qs.write_text("\n".join(QUESTIONS) + "\n")
    return model, doc, qs, root


def _chat(*args):
    r = CliRunner().invoke(app, ["chat", *args, "--dtype", "float32", "--max-new-tokens", str(NEW), "--json"])
    assert r.exit_code == 0, r.output
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


def _expected(model, doc, questions, *, chat, conversation=False, answers=None):
    tok = load_tokenizer(model)
    ids, comp = P.document_ids(tok, doc.read_text(), chat=chat)
    out = []
    for i, q in enumerate(questions):
        turn = P.question_ids(tok, q, comp, next_turn=conversation and i > 0)
        want = tiny_models.hf_greedy(model, (ids if conversation else list(ids)) + turn, NEW)
        out.append(want)
        if conversation:
            ids = ids + turn + answers[i]
    return out


@pytest.mark.parametrize("nproc", [1, 3])
def test_answers_equal_transformers_on_document_plus_question(setup, nproc):
    model, doc, qs, _ = setup
    recs = _chat(
        "--model", str(model), "--prompt-file", str(doc), "--questions", str(qs), "--no-chat", "--nproc", str(nproc)
    )
    assert [r["question"] for r in recs] == QUESTIONS
    assert [r["token_ids"] for r in recs] == _expected(model, doc, QUESTIONS, chat=False)
    assert all(
        r["context_tokens"] == recs[0]["context_tokens"] - recs[0]["prompt_tokens"] + r["prompt_tokens"] for r in recs
    )  # every question against the document alone


def test_a_question_longer_than_the_pools_room_per_slot_is_answered(setup, tmp_path):
    """chat sizes its pool for --batch questions of QUESTION_ROOM tokens at once, and for one
    question as long as the model's context allows: a question of more tokens than the room of
    every slot together (here --batch 1) is answered, and as transformers answers it, not left
    unanswered for want of blocks."""
    from treeattn_cli.cli.chat import QUESTION_ROOM

    _, doc, _, _ = setup
    long_ctx = tiny_models.make_model("llama", tmp_path / "m", seed=3, max_position_embeddings=2048)
    question = "which tower stands by the iron bridge, and which clock is right? " * 20
    tok = load_tokenizer(long_ctx)
    ids, comp = P.document_ids(tok, doc.read_text(), chat=False)
    turn = P.question_ids(tok, question, comp)
    assert len(turn) > QUESTION_ROOM + NEW and len(ids) + len(turn) + NEW < 2048, (len(ids), len(turn))
    (tmp_path / "q.txt").write_text(question + "\n")
    recs = _chat(
        "--model",
        str(long_ctx),
        "--prompt-file",
        str(doc),
        "--questions",
        str(tmp_path / "q.txt"),
        "--no-chat",
        "--nproc",
        "2",
        "--batch",
        "1",
    )
    assert [r["stop_reason"] for r in recs] == ["length"], recs
    assert [r["token_ids"] for r in recs] == [tiny_models.hf_greedy(long_ctx, ids + turn, NEW)]


@pytest.mark.parametrize("batch", ["1", "2"])
def test_a_refused_question_is_one_error_line_the_others_are_answered_and_the_exit_is_2(setup, tmp_path, batch):
    """A question too long for the model's context, between two good ones (one at a time, and a
    batch): one error line for it, the others answered as transformers answers them, and the
    run ends with exit status 2 (a script sees that a question went unanswered)."""
    model, doc, _, _ = setup
    good = [QUESTIONS[0], QUESTIONS[2]]
    qs = tmp_path / "q.txt"
    qs.write_text(f"{good[0]}\n{'the towers and the clocks ' * 120}\n{good[1]}\n")
    r = CliRunner().invoke(
        app,
        [
            "chat",
            "--model",
            str(model),
            "--prompt-file",
            str(doc),
            "--questions",
            str(qs),
            "--no-chat",
            "--nproc",
            "2",
            "--batch",
            batch,
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(NEW),
            "--json",
        ],
    )
    assert r.exit_code == 2, r.output
    errors = [x for x in r.stderr.splitlines() if x.startswith("treeattn: error: ")]
    assert len(errors) == 1 and "exceeds the model's context" in errors[0], r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [x["question"] for x in recs] == good
    assert [x["token_ids"] for x in recs] == _expected(model, doc, good, chat=False)


def test_chat_template_composition_equals_generate(setup, tmp_path):
    """With a chat template the document and the question form one user message: the answer is
    the one `generate --chat` gives for that message."""
    model, doc, qs, _ = setup
    recs = _chat("--model", str(model), "--prompt-file", str(doc), "--questions", str(qs), "--nproc", "2")
    tok = load_tokenizer(model)
    for q, r in zip(QUESTIONS, recs):
        whole = tok.apply_chat_template(
            [{"role": "user", "content": f"{doc.read_text()}\n\n{q}"}], add_generation_prompt=True, tokenize=True
        )
        whole = whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "input_ids") else whole
        assert r["token_ids"] == tiny_models.hf_greedy(model, list(whole), NEW), q
    one = tmp_path / "one.txt"
    one.write_text(f"{doc.read_text()}\n\n{QUESTIONS[1]}")
    g = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--prompt-file",
            str(one),
            "--chat",
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(NEW),
            "--json",
            "--nproc",
            "2",
        ],
    )
    assert g.exit_code == 0, g.output
    assert json.loads(g.stdout.strip().splitlines()[-1])["token_ids"] == recs[1]["token_ids"]


def test_conversation_equals_transformers_on_the_whole_conversation(setup):
    model, doc, qs, _ = setup
    recs = _chat(
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--nproc",
        "2",
        "--conversation",
    )
    answers = [r["token_ids"] for r in recs]
    assert answers == _expected(model, doc, QUESTIONS, chat=False, conversation=True, answers=answers)


def test_reset_in_a_conversation_returns_to_the_document(setup, tmp_path):
    """--conversation keeps each turn in the document's blocks; /reset gives them back: the
    first question asked again answers as it did, the second as after the first turn."""
    model, doc, _, _ = setup
    qs = tmp_path / "qs.txt"
    qs.write_text(f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n/reset\n{QUESTIONS[0]}\n")
    recs = _chat(
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--nproc",
        "2",
        "--conversation",
    )
    answers = [r["token_ids"] for r in recs]
    assert len(recs) == 3 and answers[2] == answers[0], answers
    assert answers[:2] == _expected(model, doc, QUESTIONS[:2], chat=False, conversation=True, answers=answers)
    assert recs[1]["context_tokens"] > recs[2]["context_tokens"] == recs[0]["context_tokens"]


def test_save_then_load_on_other_meshes(setup, tmp_path):
    """A cache saved from 3 ranks loads onto 2 ranks (and is saved again from there, in the same
    run, then loaded onto 1), and onto 4 ranks as 2 sequence shards x 2 tensor-parallel ranks
    (re-sharded by position and by KV head), with the same answers."""
    model, doc, qs, _ = setup
    kv = tmp_path / "kv"
    first = _chat(
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--nproc",
        "3",
        "--save-kv",
        str(kv),
    )
    m = json.loads((kv / "manifest.json").read_text())
    assert m["mesh"] == {"nproc": 3, "tp": 1, "cp": 3} and len(m["shards"]) == 3
    kv2 = tmp_path / "kv2"  # loaded and saved again elsewhere in one run: re-sharded for 2 ranks
    again = _chat(
        "--model", str(model), "--load-kv", str(kv), "--questions", str(qs), "--nproc", "2", "--save-kv", str(kv2)
    )
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in first]
    m2 = json.loads((kv2 / "manifest.json").read_text())
    assert m2["mesh"] == {"nproc": 2, "tp": 1, "cp": 2} and m2["tokens"] == m["tokens"], m2
    third = _chat("--model", str(model), "--load-kv", str(kv2), "--questions", str(qs), "--nproc", "1")
    assert [r["token_ids"] for r in third] == [r["token_ids"] for r in first]
    g = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--load-kv",
            str(kv),
            "--prompt",
            QUESTIONS[2],
            "--nproc",
            "4",
            "--tp",
            "2",
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(NEW),
            "--json",
        ],
    )
    assert g.exit_code == 0, g.output
    assert json.loads(g.stdout.strip().splitlines()[-1])["token_ids"] == first[2]["token_ids"]


def test_bad_saved_caches_are_refused(setup, tmp_path):
    """Another model, a truncated or corrupt shard, a missing manifest, another dtype: exit 2
    with one line saying which, before any rank starts."""
    import shutil

    model, doc, qs, root = setup
    kv = tmp_path / "kv"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--prompt-file",
            str(doc),
            "--no-chat",
            "--nproc",
            "2",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "1",
            "--save-kv",
            str(kv),
        ],
    )
    assert r.exit_code == 0, r.output
    other = tiny_models.make_model("llama", tmp_path / "other", seed=99)
    cases = {"another model": (other, kv)}
    for name, damage in (
        ("truncated", lambda d: os.truncate(d / "kv-c1-t0.safetensors", 100)),
        ("corrupt", lambda d: (d / "kv-c0-t0.safetensors").write_bytes(b"\xff" * 64)),
        ("no manifest", lambda d: (d / "manifest.json").unlink()),
    ):
        bad = tmp_path / name.replace(" ", "-")
        shutil.copytree(kv, bad)
        damage(bad)
        cases[name] = (model, bad)
    for name, (m, d) in cases.items():
        p = CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                str(m),
                "--load-kv",
                str(d),
                "--prompt",
                "hi",
                "--dtype",
                "float32",
                "--nproc",
                "2",
            ],
        )
        err = p.stderr.strip().splitlines()
        assert p.exit_code == 2 and len(err) == 1 and err[0].startswith("treeattn: error:"), (name, p.stderr)
        assert {
            "another model": "another model",
            "truncated": "truncated",
            "corrupt": "corrupt",
            "no manifest": "manifest",
        }[name] in err[0], (name, err)
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--load-kv",
            str(kv),
            "--prompt",
            "hi",
            "--dtype",
            "bfloat16",
            "--nproc",
            "2",
        ],
    )
    assert_usage_error(r, "float32")


def test_ctrl_c_stops_an_answer_and_the_next_question_is_answered(setup, tmp_path):
    """Through a pseudo-terminal, as a person types: an answer streams, Ctrl-C stops it within
    a moment and the prompt returns with the engine alive; the next question is answered in
    full; Ctrl-D leaves with exit status 0."""
    model, doc, _, _ = setup
    slow = tiny_models.make_model(
        "llama",
        tmp_path / "slow",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=8,
        max_position_embeddings=4096,
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: treeattn chat on a terminal
        os.execv(
            TREEATTN,
            [
                TREEATTN,
                "chat",
                "--model",
                str(slow),
                "--prompt-file",
                str(doc),
                "--no-chat",
                "--nproc",
                "2",
                "--max-new-tokens",
                "200",
                "--dtype",
                "float32",
            ],
        )
    buf = bytearray()

    def until(pred, timeout=60):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    buf.extend(os.read(fd, 65536))
                except OSError:
                    return False
                if pred(bytes(buf)):
                    return True
        return False

    prompt = lambda b, at: b[at:].endswith(b"]\r\n> ")  # noqa: E731  (after an answer's stats line)
    try:
        assert until(lambda b: b.endswith(b"> ")), bytes(buf[-500:])
        at = len(buf)
        os.write(fd, b"tell me everything\r")
        assert until(lambda b: len(b) - at > 60)  # streaming
        os.write(fd, b"\x03")
        # the event: the prompt returns after a stats line that says so (within 20 s: "a moment",
        # generous for a loaded machine), the answer cut short of its 200 tokens
        assert until(lambda b: prompt(b, at), 20), bytes(buf[-500:])
        stats = re.search(rb"([\d,]+) new tokens[^\]\n]*, interrupted\]", bytes(buf[at:]))
        assert stats and int(stats.group(1).replace(b",", b"")) < 200, bytes(buf[-500:])
        at = len(buf)
        os.write(fd, b"and now the rest\r")
        assert until(lambda b: prompt(b, at), 60), bytes(buf[-500:])
        assert b" 200 new tokens" in buf[at:] and b"interrupted" not in buf[at:]
        os.write(fd, b"\x04")
        # the event: it exits (the ranks stop; bound generous for a loaded machine). A deadline by
        # the clock, not a count of reads: once the child has closed its terminal a read returns at
        # once, and a process still in the kernel's exit (closing its files) is not yet reaped.
        deadline = time.monotonic() + 60
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            until(lambda b: False, 0.1)  # drain the terminal (a full one would block the child)
            time.sleep(0.05)  # (a closed terminal answers at once)
        done, status = done
        kernel = ""
        if not done:  # what each process is doing: their stacks (kill -USR1), in the message
            kernel = kernel_view([pid, *descendants(pid)])  # (also past Python's finalization)
            for p in [pid, *rank_pids(pid)]:
                try:
                    os.kill(p, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            until(lambda b: False, 3)
        # (as text: a bytes repr is one line pytest cuts short, and the stacks are what to read)
        assert done and os.waitstatus_to_exitcode(status) == 0, (
            bytes(buf[-12000:]).decode(errors="replace") + "\n" + kernel
        )
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_sigterm_keeps_the_answer_so_far_and_leaves_nothing(setup, tmp_path):
    """SIGTERM during an answer (Slurm, systemd, `timeout`): the answer so far is printed (its
    --json record says "terminated"), exit status 143, and no process is left."""
    import signal
    import subprocess

    from helpers import descendants, still_running

    model, doc, qs, _ = setup
    slow = tiny_models.make_model(
        "llama",
        tmp_path / "slow",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=8,
        max_position_embeddings=4096,
    )
    p = subprocess.Popen(
        [
            TREEATTN,
            "chat",
            "--model",
            str(slow),
            "--prompt-file",
            str(doc),
            "--questions",
            str(qs),
            "--no-chat",
            "--nproc",
            "2",
            "--max-new-tokens",
            "3000",
            "--dtype",
            "float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    out, err = [], []  # read both pipes as they come: the signal goes once the answer has begun
    readers = [
        threading.Thread(target=lambda f=f, acc=acc: acc.extend(iter(lambda: f.read1(4096), b"")), daemon=True)
        for f, acc in ((p.stdout, out), (p.stderr, err))
    ]
    for r in readers:
        r.start()
    t0 = time.monotonic()  # the event: the first answer streams, however slow the machine
    while not b"".join(out).strip() and time.monotonic() - t0 < 120:
        assert p.poll() is None, b"".join(err).decode()[-1000:]
        time.sleep(0.05)
    tree = descendants(p.pid)
    assert len(tree) >= 4, tree  # tracker, server, 2 ranks
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    for r in readers:
        r.join(timeout=10)
    assert p.returncode == 143, b"".join(err).decode()[-1000:]
    stats = b"".join(err).decode().strip().splitlines()[-1]
    assert stats.endswith("terminated]") and " 0 new tokens" not in stats, stats  # the answer so far, kept
    assert b"".join(out).strip()
    assert not still_running(tree), tree


def test_a_closed_pipe_ends_the_run_quietly(setup, tmp_path):
    """`treeattn chat --json ... | head -c 50` and `treeattn generate ... | head -c 5`: once
    the reader has gone, the run stops without a word on stderr (SIGPIPE's status, 141), no
    rank is left, and generate's --output still holds the text so far."""
    import subprocess

    model, doc, _, _ = setup
    many = tmp_path / "many.txt"  # answers keep coming long after the reader has gone
    many.write_text("\n".join(QUESTIONS * 20) + "\n")
    common = ["--model", str(model), "--prompt-file", str(doc), "--no-chat", "--nproc", "2", "--dtype", "float32"]
    for cmd in (
        ["chat", *common, "--questions", str(many), "--batch", "2", "--json", "--max-new-tokens", str(NEW)],
        ["generate", *common, "--max-new-tokens", "200", "--output", str(tmp_path / "out.txt")],
    ):
        p = subprocess.Popen([TREEATTN, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        head = p.stdout.read(50 if cmd[0] == "chat" else 5)
        p.stdout.close()  # what `head -c N` does once it has its bytes
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141, err
        assert head and "error" not in err and "Traceback" not in err and "interrupted" not in err, err
        if cmd[0] == "generate":  # not even the stats line: nobody interrupted anything
            assert err.strip() == "", err
    assert (tmp_path / "out.txt").read_bytes().startswith(head)


def test_output_holds_every_answer_in_the_order_shown(setup, tmp_path):
    """`chat --output FILE` (issue 39 item 5): the answers, each followed by a newline, in question
    order, written as each is shown (a batch of 2 over 3 questions); a folder that does not exist
    is refused before anything runs."""
    from helpers import assert_usage_error

    model, doc, qs, _ = setup
    out = tmp_path / "answers.txt"
    recs = _chat(
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--questions",
        str(qs),
        "--no-chat",
        "--nproc",
        "2",
        "--batch",
        "2",
        "--output",
        str(out),
    )
    assert [r["question"] for r in recs] == QUESTIONS
    assert out.read_bytes() == "".join(r["text"] + "\n" for r in recs).encode()  # bytes: a "\r" stays
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".treeattn-")]
    assert_usage_error(
        CliRunner().invoke(
            app,
            [
                "chat",
                "--model",
                str(model),
                "--prompt-file",
                str(doc),
                "--questions",
                str(qs),
                "--output",
                str(tmp_path / "no" / "a.txt"),
            ],
        ),
        "no such directory",
    )


def test_no_questions_is_said_not_silent(setup, tmp_path):
    """`chat < /dev/null` or an empty --questions file: the document is prefilled (a run may be
    meant to --save-kv it) and the run says nothing was asked, exit 0 (issue 39 item 8)."""
    model, doc, _, _ = setup
    empty = tmp_path / "none.txt"
    empty.write_text("\n\n")
    for batch in ("1", "4"):
        kv = tmp_path / f"kv{batch}"
        r = CliRunner().invoke(
            app,
            [
                "chat",
                "--model",
                str(model),
                "--prompt-file",
                str(doc),
                "--questions",
                str(empty),
                "--no-chat",
                "--nproc",
                "1",
                "--dtype",
                "float32",
                "--batch",
                batch,
                "--save-kv",
                str(kv),
            ],
        )
        assert r.exit_code == 0, r.output
        assert f"no questions in {empty}" in r.stderr and r.stdout == "", (batch, r.stderr)
        assert json.loads((kv / "manifest.json").read_text())["tokens"]["count"] > 0, batch  # saved all the same
    from treeattn_cli.storage.kvstore import load_ids

    assert load_ids(tmp_path / "kv1") == load_ids(tmp_path / "kv4")  # --batch 4 saved the document from its pool


def test_questions_from_a_file_are_shown_before_their_answers(setup):
    """Plain chat (no --json) with questions from a file or a pipe: each question on stderr before
    its answer streams (stdout stays the answers alone), one at a time and batched (issue 39)."""
    model, doc, qs, _ = setup
    for batch in ("1", "2"):
        r = CliRunner().invoke(
            app,
            [
                "chat",
                "--model",
                str(model),
                "--prompt-file",
                str(doc),
                "--questions",
                str(qs),
                "--no-chat",
                "--nproc",
                "1",
                "--dtype",
                "float32",
                "--max-new-tokens",
                str(NEW),
                "--batch",
                batch,
            ],
        )
        assert r.exit_code == 0, r.output
        shown = [line[2:] for line in r.stderr.splitlines() if line.startswith("> ")]
        assert shown == QUESTIONS, (batch, r.stderr)
        assert "> " not in r.stdout


def test_save_at_the_prompt_saves_the_pooled_document(setup, tmp_path):
    """`/save DIR` between questions (no --conversation: the document is in the ranks' block pool)
    saves the document alone, whatever was asked before; loaded back with --load-kv on another
    number of ranks, it answers the next question as transformers does after the document."""
    model, doc, _, _ = setup
    qs = tmp_path / "qs.txt"
    kv = tmp_path / "kv"
    qs.write_text(f"{QUESTIONS[0]}\n/save {kv}\n")
    r = CliRunner().invoke(
        app,
        [
            "chat",
            "--model",
            str(model),
            "--prompt-file",
            str(doc),
            "--questions",
            str(qs),
            "--nproc",
            "2",
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(NEW),
            "--json",
            "--batch",
            "1",
        ],
    )  # (with --batch, /commands are refused)
    assert r.exit_code == 0, r.output
    assert f"cached tokens to {kv}" in r.stderr, r.stderr
    from treeattn_cli.storage.kvstore import load_ids

    tok = load_tokenizer(model)
    doc_ids, _ = P.document_ids(tok, doc.read_text(), chat=True)
    assert load_ids(kv) == doc_ids  # the document only: the answer before it is not in it
    q2 = tmp_path / "q2.txt"
    q2.write_text(QUESTIONS[1] + "\n")
    got = _chat("--model", str(model), "--load-kv", str(kv), "--questions", str(q2), "--nproc", "1")
    assert [g["token_ids"] for g in got] == _expected(model, doc, QUESTIONS[1:2], chat=True)
