"""``--cite`` in the launching process: a document's spans for the ranks, their masses back as
citations (issue 37; the ranks' side is ``engine/cite.py``).

Before the run, the document's text is cut into spans (sentences; a sentence too short to stand
alone joins the next), and each span is placed on the prompt's tokens (the character offsets of
the tokenizer over the text exactly as it was tokenized, chat template included), giving the
ranges of global positions the ranks sum attention over. After the answer, rank 0's ``[rows,
spans]`` masses become citations: character offsets into the text the user gave (the file's
text for ``--prompt-file``, not the templated string), best first, and for each sentence of the
answer the span its rows read most.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from ..engine.cite import SINK_POSITIONS, span_scores

MIN_WORDS = 6  # a sentence of fewer words joins the next one of its paragraph (headings, "Fig. 3.")
TOP = 5  # citations a record keeps, best first
MIN_SPANS = 2  # a document of fewer spans is too short to cite
MIN_TOKENS = 32  # ... or of fewer tokens (cli/prompt.MIN_DOCUMENT: not worth a cache entry either)

_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")  # after . ! ? (and closing quotes), or a line break
_WORD = re.compile(r"\w+")


class CiteError(ValueError):
    """``--cite`` cannot be given for this prompt; the message is one line for the user."""


def split_spans(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """Character ranges ``[a, b)`` of the sentences of ``text[start:end]``, in order, stripped of
    surrounding whitespace; a sentence of fewer than :data:`MIN_WORDS` words joins the next one
    of its paragraph (the last one of a paragraph joins the one before), so headings, list
    labels and abbreviations do not stand alone."""
    end = len(text) if end is None else end
    out = []
    p0 = start
    for m in list(_PARAGRAPH.finditer(text, start, end)) + [None]:
        p1 = m.start() if m else end
        sents, s0 = [], p0
        for e in list(_SENTENCE_END.finditer(text, p0, p1)) + [None]:
            s1 = e.start() if e else p1
            a, b = _strip(text, s0, s1)
            if b > a:
                sents.append([a, b])
            s0 = e.end() if e else p1
        merged: list = []
        for a, b in sents:
            if merged and len(_WORD.findall(text, merged[-1][0], merged[-1][1])) < MIN_WORDS:
                merged[-1][1] = b  # the short one before takes this one in
            else:
                merged.append([a, b])
        if len(merged) > 1 and len(_WORD.findall(text, *merged[-1])) < MIN_WORDS:
            last = merged.pop()
            merged[-1][1] = last[1]
        out += [tuple(x) for x in merged]
        p0 = m.end() if m else end
    return out


def _strip(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


@dataclass
class DocumentSpans:
    """The spans of a document: ``chars`` in ``text`` (what citations' offsets refer to) and
    ``positions``, the global token positions ``[start, end)`` each covers (same order)."""

    text: str
    chars: list
    positions: list

    def spec(self, layers=None, detail: str = "sum") -> dict:
        """What a request's ``cite`` carries to the ranks (``engine.Engine.citation``)."""
        return {"spans": [list(p) for p in self.positions], "layers": layers, "detail": detail}

    def line_of(self, offset: int) -> int:
        """The 1-based line of character ``offset`` in the text."""
        return self.text.count("\n", 0, offset) + 1


def place(
    tokenizer, ids: list, rendered: str, at: int, text: str, doc: tuple[int, int], *, special: bool
) -> DocumentSpans:
    """The spans of ``text[doc[0]:doc[1]]`` placed on ``ids``: the tokens of ``rendered`` (the
    prompt as tokenized, ``special``: with the tokenizer's special tokens), in which ``text``
    begins at character ``at``. A token belongs to the span holding its first non-space
    character; positions below :data:`engine.cite.SINK_POSITIONS` never count (attention
    sinks). Raises :class:`CiteError` when the text's tokens cannot be placed or are too few."""
    enc = tokenizer(rendered, add_special_tokens=special, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        raise CiteError(
            "--cite: the prompt's text does not tokenize to the prompt's tokens here (its chat "
            "template rewrites it), so citations could not be placed on it; try --no-chat"
        )
    chars = split_spans(text, *doc)
    starts = [a for a, _ in chars]
    first: dict = {}
    last: dict = {}
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        a, b = max(a - at, doc[0]), min(b - at, doc[1])
        while a < b and text[a].isspace():
            a += 1
        if a >= b or i < SINK_POSITIONS:
            continue
        s = bisect.bisect_right(starts, a) - 1
        if s < 0 or a >= chars[s][1]:
            continue  # between spans
        first.setdefault(s, i)
        last[s] = i
    keep = sorted(first)
    spans = DocumentSpans(text, [chars[s] for s in keep], [(first[s], last[s] + 1) for s in keep])
    tokens = sum(b - a for a, b in spans.positions)
    if len(keep) < MIN_SPANS or tokens < MIN_TOKENS:
        raise CiteError(
            f"--cite: the document part of the prompt is too short to cite ({tokens} tokens in "
            f"{len(keep)} sentence(s); at least {MIN_TOKENS} tokens in {MIN_SPANS} sentences, "
            "before the question's paragraph)"
        )
    return spans


def _render(tokenizer, messages: list, content: str, what: str) -> tuple[str, int]:
    """``(rendered, at)``: ``messages`` through the chat template (the assistant's turn opened, as
    the prompt is tokenized), and where ``content`` begins in it; :class:`CiteError` if the
    template did not keep it intact."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    at = rendered.rfind(content)
    if at < 0:
        raise CiteError(
            f"{what}: the chat template does not keep the text intact, so citations could not be "
            "placed on it; try --no-chat"
        )
    return rendered, at


def _system(system: str | None) -> list:
    return [{"role": "system", "content": system}] if system else []


def for_prompt(tokenizer, text: str, ids: list, *, chat: bool, system: str | None) -> DocumentSpans:
    """``generate``'s prompt: the document is its text up to the last paragraph break (what
    follows is the question, which is not cited); a text without one is all document."""
    cut = text.rfind("\n\n")
    doc = (0, cut if cut > 0 else len(text))
    if not chat:
        return place(tokenizer, ids, text, 0, text, doc, special=True)
    rendered, at = _render(tokenizer, _system(system) + [{"role": "user", "content": text}], text, "--cite")
    return place(tokenizer, ids, rendered, at, text, doc, special=False)


def for_document(tokenizer, document: str, ids: list, composition: dict, *, system: str | None) -> DocumentSpans:
    """``chat``'s document (``prompt.document_ids``: its ``ids`` and ``composition``); questions
    follow it and are not cited."""
    from .prompt import SENTINEL

    if composition.get("kind") != "chat-document":
        return place(tokenizer, ids, document, 0, document, (0, len(document)), special=True)
    msgs = _system(system) + [{"role": "user", "content": f"{document}\n\n{SENTINEL}"}]
    rendered, at = _render(tokenizer, msgs, document, "--cite")
    return place(tokenizer, ids, rendered.split(SENTINEL)[0], at, document, (0, len(document)), special=False)


def for_request(tokenizer, ids: list, *, messages: list | None = None, prompt: str | None = None) -> DocumentSpans:
    """A ``serve`` request's document part (``prompt.split_chat`` / ``split_completion``: the text
    before the last paragraph break of the last user message, or of the prompt), placed on its
    tokens ``ids``; offsets are into that message's content (or the prompt)."""
    if messages is not None:
        last = next((m for m in reversed(messages) if m.get("role") == "user"), None)
        text = last.get("content") if last else None
        if not isinstance(text, str):
            raise CiteError("'cite' needs a document in the last user message (text before a blank line)")
        (rendered, at), special = _render(tokenizer, messages, text, "'cite'"), False
    else:
        text, rendered, at, special = prompt, prompt, 0, True
    cut = text.rfind("\n\n")
    if cut <= 0:
        raise CiteError(
            "'cite' needs a document part: the text before the last blank line of the "
            + ("last user message" if messages is not None else "prompt")
            + " (there is none)"
        )
    return place(tokenizer, ids, rendered, at, text, (0, cut), special=special)


def citations(spans: DocumentSpans, masses, tokenizer, answer_ids: list, top: int = TOP) -> dict:
    """The record's ``citations`` (``{"start", "end", "score", "text"}``, best first, at most
    ``top``; ``score``: the share of the answer's attention the span received, averaged over its
    rows, the counted layers and every head; the order is ``engine.cite.span_scores``'s, which
    weighs that share by the span's length) and ``sentence_citations`` (each sentence of the answer: its ``start``, ``end`` and
    ``text`` in the answer, and ``citation``, the span its rows read most, with that score) from
    ``masses [rows, spans]`` (``engine.cite.Citation.gather``). Row r is the step fed with
    answer token r, which chose token r + 1."""
    import numpy as np

    m = np.asarray(masses, dtype=np.float64).reshape(-1, len(spans.chars))
    lengths = np.array([b - a for a, b in spans.positions], dtype=np.float64)
    out = {"citations": [], "sentence_citations": []}
    if m.shape[0] == 0:
        return out
    order, share = span_scores(m, lengths), m.mean(0)
    for s in np.argsort(-order, kind="stable")[:top]:
        if order[s] > 0:
            out["citations"].append(_span(spans, int(s), float(share[s])))
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    ends = [len(tokenizer.decode(answer_ids[: i + 1], skip_special_tokens=True)) for i in range(len(answer_ids))]
    for a, b in split_spans(answer):
        rows = [r for r in range(m.shape[0]) if r + 1 < len(ends) and a < ends[r + 1] and ends[r] < b]
        if not rows:
            continue
        own = span_scores(m[rows], lengths)
        s = int(np.argmax(own))
        if own[s] > 0:
            out["sentence_citations"].append(
                {
                    "start": a,
                    "end": b,
                    "text": answer[a:b],
                    "citation": _span(spans, s, float(m[rows, s].mean()), text=False),
                }
            )
    return out


def _span(spans: DocumentSpans, s: int, score: float, text: bool = True) -> dict:
    a, b = spans.chars[s]
    rec = {"start": a, "end": b, "score": round(score, 6)}
    if text:
        rec["text"] = spans.text[a:b]
    return rec
