"""The "Sources" list a person reads after an answer given with ``--cite`` (presentation only; the
citations themselves come from ``citations.py``): numbered, quoted snippets of the document with
their line numbers, the words they share with the answer highlighted, and the share of the
answer's attention each received."""

from __future__ import annotations

import re
import sys

SHOWN = 3  # sources listed
WIDTH = 160  # characters of a snippet around its shared words
_WORD = re.compile(r"\w+")
# words too common to show that an answer and a passage agree
_COMMON = frozenset(
    """a an the and or but of to in on at by for with from as is are was were be been being it its
this that these those there here he she they them his her their we you your our not no yes do does did has have had
what which who whom whose when where why how than then so such can could would should may might will shall about
into over under after before also only just very more most other some any all each both""".split()
)


def show(rec: dict, spans, file=None, where: str = "the document") -> None:
    """Print the Sources of an answer's record (``rec["citations"]``, ``rec["text"]``) on
    ``file`` (default stderr, beside the stats line: stdout stays the answer alone)."""
    from rich.console import Console
    from rich.text import Text

    console = Console(file=file or sys.stderr, highlight=False, soft_wrap=True)
    cits = rec.get("citations") or []
    if not cits:
        console.print(Text(f"[no sources: the answer's tokens gave {where} no attention to cite]", style="dim"))
        return
    words = {w.lower() for w in _WORD.findall(rec.get("text", "")) if len(w) > 2} - _COMMON
    console.print(Text("Sources", style="bold"))
    for i, c in enumerate(cits[:SHOWN], 1):
        a, b = spans.line_of(c["start"]), spans.line_of(max(c["start"], c["end"] - 1))
        line = Text(
            f" {i}. line {a}" + (f"-{b}" if b != a else "") + f" ({c['score']:.1%} of the attention): ", style="cyan"
        )
        line.append_text(_snippet(c["text"], words))
        console.print(line)


def _snippet(text: str, words: set):
    """``text`` quoted on one line, cut to about :data:`WIDTH` characters around its first word
    shared with the answer, the shared words in bold."""
    from rich.text import Text

    flat = " ".join(text.split())
    hits = [m for m in _WORD.finditer(flat) if m.group().lower() in words]
    start = 0
    if len(flat) > WIDTH and hits:
        start = max(0, min(hits[0].start() - WIDTH // 4, len(flat) - WIDTH))
    end = min(len(flat), start + WIDTH)
    out = Text("\u201c" + ("\u2026" if start else ""))
    at = start
    for m in hits:
        if m.start() < start or m.end() > end:
            continue
        out.append(flat[at : m.start()])
        out.append(m.group(), style="bold yellow")
        at = m.end()
    out.append(flat[at:end] + ("\u2026" if end < len(flat) else "") + "\u201d")
    return out
