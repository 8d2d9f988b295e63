"""``treeattn chat``: a long document prefilled once, then many questions (the launcher side).

The ranks run a persistent engine (``engine.rank_engine``) in a background thread of this
process (``launch.run_local``); this thread owns the terminal and the signals. It posts requests
through the rendezvous store (``comm.post_request``) and reads rank 0's events (tokens, answer
stats) from a queue:

    batch(doc, no question)                             once: the document resident (bar, --save-kv)
    batch(doc, question)                                per question
    batch(doc, question kept) · mark/rollback(doc)      --conversation; /reset

``batch`` requests name the document as their questions' document (``{"doc": {"key", "ids"}}``,
as ``serve`` does), and the ranks prefill it (or load ``--load-kv``, or save ``--save-kv`` once
it is complete) into their block pool, sized to hold it, ``--batch`` questions at once, and a
question as long as the model's context allows (with ``--conversation``, its turns too); the
questions decode over its blocks, ``--batch`` at a time from a file or a pipe (one request),
else one request per question. With ``--conversation`` each question and its answer
join the document's blocks (``keep``), so the next question continues them; ``/reset`` rolls the
document back to its mark.

Ctrl-C during an answer stops that answer (``comm.post_interrupt``; rank 0 ends it on the next
token, every rank in step) and returns to the prompt; Ctrl-D or ``/exit`` leaves; ``/reset``
returns to the document; ``/save DIR`` saves the cache. SIGTERM stops everything like
``generate`` (exit 143).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from ..engine.requests import Ask, DocRef, document_key
from ..engine.sampling import Sampling
from ..parallel import forkserver, launch
from . import prompt as P
from ..report import GenerateView, batch_line, stats_line, stdout_closed
from ..serving.engine_client import ResidentEngine
from .options import ChatOptions
from .prepare import prepare_run

# Tokens of a question the KV pool is sized to hold beside the document and the answer, for each
# of --batch at a time (a question alone may take the room of them all: the pool's blocks are
# shared). The pool also holds at least what the model's whole context takes (up to the device's
# default pool, room.POOL_BYTES), so one question as long as the context allows fits alone;
# one that still cannot fit is not answered, and says so.
QUESTION_ROOM = 256
HELP = "/exit (or Ctrl-D) leaves · /reset returns to the document · /save DIR saves the cache · Ctrl-C stops an answer"


def _question_source(o: ChatOptions):
    """Questions: from --questions (a file, or '-' for standard input), or from the terminal
    (line editing and history; a pasted block of lines is one question; a line ending in
    a backslash continues), or from piped standard input, one per line."""
    if o.questions is not None:
        f = sys.stdin if o.questions == "-" else open(o.questions, encoding="utf-8")
        for line in f:
            if line.strip():
                yield line.rstrip("\n")
        return
    if not sys.stdin.isatty():
        for line in sys.stdin:
            if line.strip():
                yield line.rstrip("\n")
        return
    import select

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"treeattn chat: ask about the document. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
            while line.endswith("\\") or select.select([sys.stdin], [], [], 0.02)[0]:
                line = (
                    (line[:-1] if line.endswith("\\") else line) + "\n" + input("" if not line.endswith("\\") else "… ")
                )
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, as in a shell
            print(file=sys.stderr)
            continue
        if line.strip():
            yield line


def chat_command(o: ChatOptions) -> int:
    """Run ``treeattn chat``; returns the exit code (0; 2 when a question was refused — too long for
    the context or the KV pool, or a command where a question belongs — after every other answer;
    1 when the ranks failed; 143 on SIGTERM)."""
    if forkserver.under_torchrun():
        raise ValueError("chat starts its own local ranks; under torchrun use generate (--load-kv continues a cache)")
    if o.prompt is not None:
        raise P.PromptError("chat reads the document from --prompt-file (questions come after it)")
    _ANSWERS.start(o.output)  # (its folder, and the --questions file, were checked with the flags)
    _REFUSED.clear()
    run = prepare_run(o)
    o.max_new_tokens = o.max_new_tokens or 256
    tok = run.tokenizer
    chat = o.chat if o.chat is not None else bool(getattr(tok, "chat_template", None))
    manifest, doc_ids = None, None
    if o.load_kv:
        manifest = run.load_kv(o.load_kv)
        composition, cached = manifest["composition"], manifest["tokens"]["count"]
    else:
        if o.prompt_file is None:
            raise P.PromptError("chat needs a document: --prompt-file DOC (or a saved cache: --load-kv DIR)")
        text = P.read_text(None, o.prompt_file, context=run.context)
        doc_ids, composition = P.document_ids(tok, text, chat=chat, system=o.system)
        cached = len(doc_ids)
    run.check_fits(cached, o.max_new_tokens, "the document")
    spans = None
    if o.cite:  # the document's sentences placed on its tokens (never with --load-kv: checked)
        from .citations import for_document

        spans = for_document(tok, text, doc_ids, composition, system=o.system)
    save_meta = (
        run.save_meta(o.save_kv, composition)
        if o.save_kv
        else {**run.cache_meta(o.cache_dir), "composition": composition}
        if o.cache_dir
        else None
    )
    job = run.job(o, [], reserve=0)  # the document lives in the ranks' block pool, not in the engine's own cache
    code = _session(o, run, job, composition, doc_ids, manifest, save_meta, spans)
    return 2 if code == 0 and _REFUSED else code


def _session(o, run, job, composition, doc_ids, manifest, save_meta, spans=None) -> int:
    engine = ResidentEngine(run, job, o.timeout)
    code = 0
    try:
        client = engine.start()
        _converse(o, run, job, client, composition, doc_ids, manifest, save_meta, spans)
        client.post(op="stop")
    except launch.Terminated:
        code = 143
    except KeyboardInterrupt:  # outside an answer (the document's prefill): stop everything
        print("treeattn: interrupted", file=sys.stderr)
        code = 130
    except launch.LaunchError as e:
        print(f"treeattn: error: {e}", file=sys.stderr)
        code = 1
    except BrokenPipeError:  # `| head`: the reader has enough; stop the ranks quietly
        code = stdout_closed()
    finally:
        if engine.thread is not None:
            engine.thread.join(timeout=30 if not code else 0)
        engine.stop(now=True)
    err = engine.error
    if not code and err is not None and not isinstance(err, launch.Stopped):
        print(f"treeattn: error: {err}", file=sys.stderr)
        code = 1
    return code


def _document(o, run, doc_ids, manifest, save_meta) -> tuple[dict, dict]:
    """The ``batch`` request's document (every question's ``doc``) and its request-wide options:
    its tokens (a saved cache's own, with ``--load-kv``), prefilled in the segments a single
    prefill cuts (``--prefill-chunk``, else all at once: the numbers ``--batch 1`` holds), saved
    once complete with ``--save-kv`` (with ``--cache-dir``: loaded from the directory if a run
    saved it there, else saved there once complete), and a pool sized to hold it (with
    ``--conversation``, its turns too)."""
    from pathlib import Path

    cp = max(1, run.nproc // o.tp)
    if manifest is not None:
        from ..storage.kvstore import load_ids

        doc_ids = load_ids(Path(o.load_kv))
    n = len(doc_ids)
    doc = DocRef(document_key(doc_ids), doc_ids, piece=o.prefill_chunk or max(1, -(-n // cp)))
    if manifest is not None:
        doc.load_from, doc.manifest = o.load_kv, manifest
    kept = {}
    if save_meta is not None:
        doc.save_to, doc.save_meta = o.save_kv, save_meta
        if o.cache_dir:  # found in the directory by its tokens, else prefilled and written there
            doc.save_to, kept = None, {"dir": o.cache_dir, "save": True}
    tails = {"tails": o.max_new_tokens + QUESTION_ROOM, "tail_slots": max(1, o.batch or 1)}
    return doc, {"pool_for": n, **tails, "grow": True, **kept}  # (grow: turns, and a question the context allows)


def _converse(o, run, job, client, composition, doc_ids, manifest, save_meta, spans=None) -> None:
    quiet = o.quiet  # as generate: stats on stderr (with --json too: stdout stays JSON lines)
    tok = run.tokenizer
    info = dict(
        nproc=run.nproc,
        tp=o.tp,
        cp=run.nproc // o.tp,
        scheme=run.plan[0],
        dtype=run.dtype,
        device=run.kind,
        kv_dtype=run.kv_dtype,
        kv_bytes_per_token=run.kv_bytes_per_token(o.tp),
    )
    turns = (manifest or {}).get("composition", {}).get("turns", 0) if manifest else 0
    cached = manifest["tokens"]["count"] if manifest else len(doc_ids)
    pooled = _document(o, run, doc_ids, manifest, save_meta)
    progress = GenerateView(tok, stream=False, progress=sys.stderr.isatty() and not o.quiet)
    _resident(o, client, pooled, cached, progress)  # prefilled, loaded; saved with --save-kv: before the first question
    if o.conversation:  # /reset comes back here: the turns kept since leave the document
        client.post(op="mark", name="doc", doc=pooled[0].key)
    elif o.batch > 1 and _from_file_or_pipe(o):
        return _batch(o, run, client, composition, cached, job.eos_ids, info, spans, pooled)
    total, last_reason, asked = cached, None, 0
    for q in _question_source(o):
        asked += 1
        cmd = q.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            if o.conversation:  # (else every question starts from the document anyway)
                client.post(op="rollback", name="doc", doc=pooled[0].key)
            total, turns, last_reason = cached, 0, None
            print("[back to the document]", file=sys.stderr)
            continue
        if cmd.startswith("/save"):
            path = cmd[5:].strip()
            if not path:
                print("treeattn: /save needs a directory", file=sys.stderr)
                continue
            try:
                meta = run.save_meta(path, {**composition, "turns": turns})
            except ValueError as e:
                print(f"treeattn: error: {e}", file=sys.stderr)
                continue
            _save(client, path, meta, quiet, doc=pooled[0].key)
            continue
        try:
            ids = P.question_ids(tok, q, composition, next_turn=o.conversation and turns > 0)
            run.check_fits(total + len(ids), o.max_new_tokens, "the document, the conversation and the question")
        except ValueError as e:
            _refuse(str(e))
            continue
        if not o.json and _from_file_or_pipe(o):
            _say_question(o, q)  # typed questions are on the screen already
        rec = _answer(
            o,
            client,
            tok,
            ids,
            job.eos_ids,
            {"question": q, **info},
            drop_pending=last_reason == "eos" and composition["kind"] == "chat-document",
            spans=spans,
            pooled=pooled,
        )
        if o.conversation and rec.get("kept", True):
            total += len(ids) + rec["new_tokens"]
            turns, last_reason = turns + 1, rec["stop_reason"]
        elif o.conversation:
            print(
                "treeattn: error: the KV pool cannot hold this turn too: the conversation goes on from before "
                "this question (/reset returns to the document)",
                file=sys.stderr,
            )
    if not asked and _from_file_or_pipe(o):
        _no_questions(o)


def _resident(o, client, pooled, tokens: int, progress) -> None:
    """The pooled document made resident now (a request with nothing to answer: prefilled with
    its progress bar, or loaded; saved with --save-kv), so the first question does not wait."""
    doc, extra = pooled

    def on_event(kind, payload):
        progress.on_event(0, kind, payload)
        if kind == "bdoc":  # resident: the bar goes, then the line that says how it came
            progress.finish()
            d = payload[1]
            if o.quiet:
                return
            if d["source"] == "disk":
                print(
                    f"[loaded {d['tokens']:,} cached tokens from {o.load_kv or o.cache_dir} in {d['seconds']:.2f} s]",
                    file=sys.stderr,
                )
            else:
                loaded = f", the first {d['loaded']:,} loaded from {o.cache_dir}, the rest" if d.get("loaded") else ""
                print(
                    f"[document: {d['tokens']:,} tokens{loaded} prefilled in {d['seconds']:.2f} s, "
                    f"{d['tokens'] / max(d['seconds'], 1e-9):,.0f} tok/s]",
                    file=sys.stderr,
                )
        elif kind == "docs" and payload.get("saved") and not o.quiet:
            print(f"[saved {tokens:,} cached tokens to {o.save_kv or o.cache_dir}]", file=sys.stderr)

    client.post(
        op="batch", seq=client.seq, slots=1, **extra, questions=[Ask([], 0, doc=replace(doc, progress=True)).wire()]
    )
    client.wait("batch_done", on_event=on_event)
    progress.finish()


def _from_file_or_pipe(o) -> bool:
    """Questions come from --questions or piped standard input, not typed at a terminal."""
    return o.questions is not None or not sys.stdin.isatty()


def _say_question(o, q: str) -> None:
    """A question from a file or a pipe, on stderr before its answer streams to stdout (which
    stays the answers alone, as --output holds them), so a reader sees what each answers."""
    if o.quiet:
        return
    sys.stdout.flush()
    print(f"> {q}", file=sys.stderr, flush=True)


def _no_questions(o) -> None:
    """Questions were to come from a file or a pipe, and none came: say so (the document was
    prefilled, and saved with --save-kv: a run may be meant for that alone)."""
    where = "standard input" if o.questions in (None, "-") else o.questions
    print(
        f"treeattn chat: no questions in {where}; the document was prefilled"
        + (f" and saved to {o.save_kv}" if o.save_kv else "")
        + ", nothing was asked",
        file=sys.stderr,
    )


def _ask(o, ids, doc: DocRef, eos_ids, spans) -> Ask:
    """A question of ``ids`` over the document, answered as the flags say."""
    return Ask(
        list(ids),
        o.max_new_tokens,
        Sampling(o.temperature, o.top_k, o.top_p, o.seed),
        list(o.stop),
        list(eos_ids),
        o.speculate,
        doc=doc,
        logprobs=o.logprobs,
        digest=bool(o.digest),
        cite=spans.spec() if spans else None,
    )


def _answer(o, client, tok, ids, eos_ids, info: dict, *, drop_pending: bool, spans=None, pooled) -> dict:
    """One question over the pooled document (``pooled``: :func:`_document`'s), a ``batch``
    request of this one question (with ``--conversation`` kept: it and its answer join the
    document), streamed, and the answer's record (printed: JSON, or the stats line; with
    ``spans``, its citations). Ctrl-C stops the answer; SIGTERM keeps what was generated and
    goes on up."""
    view = GenerateView(tok, stream=not o.json, progress=False)
    doc, extra = pooled
    ask = _ask(o, ids, doc, eos_ids, spans)
    ask.keep, ask.drop_pending = bool(o.conversation), bool(o.conversation and drop_pending)
    seq = client.post(
        op="batch", seq=client.seq, slots=1, piece=o.prefill_chunk, **extra, interruptible=True, questions=[ask.wire()]
    )
    got: dict = {}

    def on_event(kind, payload):
        if kind == "btoken":
            view.on_event(0, "token", payload[1])
        elif kind == "banswer":
            got["answer"] = payload[1]

    def wait():
        client.wait("batch_done", on_event=on_event)
        return got["answer"]

    try:
        while True:
            try:
                summary = wait()
                break
            except launch.Terminated:
                raise
            except KeyboardInterrupt:  # stop this answer; the engine stays
                client.interrupt(seq)
    except launch.Terminated:
        _show(o, {**view.finish(stop_reason="terminated"), **info})
        raise
    view.summary = {k: v for k, v in summary.items() if k not in ("token_ids", "kept")}
    rec = {**view.finish(), **info}
    _show(o, rec, spans, tok)
    return {**rec, "kept": summary.get("kept", True)}


def _batch(o, run, client, composition, cached: int, eos_ids, info: dict, spans, document) -> None:
    """Questions from a file or a pipe, ``--batch`` of them decoding together over the document
    (the engine's ``batch`` request). Answers stream and print in question order: the first
    unanswered question's text streams as it comes, the later ones' wait their turn; each gets
    its record (or stats line) as usual, and a line of aggregate numbers ends the batch.
    ``document``: ``(doc, options)`` of :func:`_document`, the document every question names
    (resident in the ranks' pool already: :func:`_resident`)."""
    tok = run.tokenizer
    questions, ids_list = [], []
    for q in _question_source(o):
        cmd = q.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd.startswith("/"):
            _refuse(
                f"{cmd.split()[0]} is not a question; with --batch only /exit is understood (--batch 1 "
                "answers one at a time)"
            )
            continue
        try:
            ids = P.question_ids(tok, q, composition)
            run.check_fits(cached + len(ids), o.max_new_tokens, "the document and the question")
        except ValueError as e:
            _refuse(str(e))
            continue
        questions.append(q)
        ids_list.append(ids)
    doc, extra = document
    if not questions:
        _no_questions(o)
        return
    n = len(questions)
    views = [GenerateView(tok, stream=False, progress=False) for _ in range(n)]
    records: list = [None] * n
    cur = [0]

    def show(i, rec):
        views[i].summary = {k: v for k, v in rec.items() if k != "token_ids"}
        _show(o, {**views[i].finish(), "question": questions[i], **info}, spans, tok)

    def begin(i):  # question i's answer streams now: the question first (on stderr)
        if not o.json:
            _say_question(o, questions[i])
            views[i].begin_stream()

    def advance():
        while cur[0] < n and records[cur[0]] is not None:
            show(cur[0], records[cur[0]])
            cur[0] += 1
            if cur[0] < n:
                begin(cur[0])

    def on_event(kind, payload):
        if kind == "btoken":
            views[payload[0]].on_event(0, "token", payload[1])
        elif kind == "banswer":
            records[payload[0]] = payload[1]
            advance()

    begin(0)
    seq = client.post(
        op="batch",
        seq=client.seq,
        slots=o.batch,
        **extra,
        interruptible=True,
        piece=o.prefill_chunk,
        questions=[_ask(o, ids, doc, eos_ids, spans).wire() for ids in ids_list],
    )
    try:
        while True:
            try:
                done = client.wait("batch_done", on_event=on_event)
                break
            except launch.Terminated:
                raise
            except KeyboardInterrupt:  # end every answer where it is; questions not begun are not asked
                client.interrupt(seq)
    except launch.Terminated:
        for i in range(cur[0], n):  # what each begun answer had, in order
            if views[i].ids:
                _show(o, {**views[i].finish(stop_reason="terminated"), "question": questions[i], **info})
        raise
    for i in range(cur[0], n):  # after Ctrl-C: the answers that exist, in order
        if records[i] is not None:
            show(i, records[i])
    if not o.quiet:
        if done.get("pools"):  # the ranks' pools as the batch ended (every rank's used and total blocks)
            print(
                f"[KV pool: {max(u for u, _ in done['pools'])} of {done['pools'][0][1]} blocks per rank "
                "in use at the end]",
                file=sys.stderr,
            )
        print(batch_line(done), file=sys.stderr)


class AnswerFile:
    """``chat --output FILE``: every answer's text, in the order the answers are shown, each
    followed by a newline; the file is rewritten atomically after each answer, so it always
    holds every answer given so far (an interrupted or stopped run keeps them)."""

    def __init__(self):
        self.path, self.texts = None, []

    def start(self, path) -> None:
        self.path, self.texts = path, []

    def add(self, text: str) -> None:
        if self.path is None:
            return
        from ..paths import write_atomic

        self.texts.append(text)
        write_atomic(self.path, "".join(t + "\n" for t in self.texts))


_ANSWERS = AnswerFile()  # one chat per process
_REFUSED: list[str] = []  # the questions refused so far (the exit status is 2 if any)


def _refuse(why: str) -> None:
    """A question not answered: one error line; the session goes on, and ends with exit status 2."""
    _REFUSED.append(why)
    print(f"treeattn: error: {why}", file=sys.stderr)


def _show(o, rec: dict, spans=None, tok=None) -> None:
    """An answer's record: its text to --output, JSON or the stats line, and with ``spans``
    (``--cite``) its citations in the record and, for a person, the Sources after it."""
    cited = rec.pop("cite", None)
    if spans is not None and cited is not None:
        from .citations import citations

        rec.update(citations(spans, cited, tok, rec["token_ids"]))
    _ANSWERS.add(rec["text"])
    if rec.get("stop_reason") == "no_room":
        _refuse(
            f"a question of {rec.get('prompt_tokens', 0):,} tokens was not answered: with its answer "
            f"(--max-new-tokens {o.max_new_tokens}) it does not fit in the KV pool beside the document"
        )
    if o.json:
        print(json.dumps(rec), flush=True)
    if not o.quiet:
        print(stats_line(rec), file=sys.stderr)
    if spans is not None and cited is not None and not o.json:
        from .sources import show

        show(rec, spans)


def _save(client, path, meta, quiet: bool, doc: str) -> None:
    """Save the resident document ``doc`` (a key: with --conversation, its kept turns too) to ``path``."""
    client.post(op="save", dir=str(path), **meta, doc=doc)
    info = client.wait("saved")
    if not quiet:
        print(f"[saved {info['tokens']:,} cached tokens to {info['dir']} in {info['seconds']:.2f} s]", file=sys.stderr)
