"""The prompt: from --prompt, --prompt-file, standard input, or the shipped demo document;
optionally through the tokenizer's chat template. Errors are one-line :class:`PromptError`."""

from __future__ import annotations

import sys

# A single fact from near the end of the ~4.5K-token document, asked in other words than the
# document's ("reimburse her for a new bicycle"): the embedded 135M model answers it right
# (greedy). Two-part questions are beyond it: asked who repaired the east telescope's drive
# motor in 1962 and with what, it answered neither.
DEMO_QUESTION = "According to the report above, what did Margit Solberg ask the board to pay for?"
DEMO_SYSTEM = "You are a careful assistant. Answer from the document, briefly."


class PromptError(ValueError):
    """A prompt that cannot be used; the message is one line for the user."""


BYTES_PER_TOKEN = 32  # generous: no tokenizer packs more text than this into a token on average
MIN_READ_LIMIT = 1 << 20
DEFAULT_READ_LIMIT = 256 << 20  # a model that does not state its context


def read_limit(context_tokens: int | None) -> int:
    """Most bytes of prompt worth reading for a model with this context: an endless or huge
    input (a FIFO, a device, a multi-GB log on stdin) is refused after reading this much,
    instead of being read whole into memory."""
    if not context_tokens:
        return DEFAULT_READ_LIMIT
    return max(MIN_READ_LIMIT, context_tokens * BYTES_PER_TOKEN)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _read_bounded(f, limit: int, where: str, context: int | None) -> bytes:
    data = f.read(limit + 1)
    if len(data) > limit:
        ctx = f"the model's context of {context} tokens" if context else "any model's context"
        raise PromptError(
            f"{where} is longer than {_size(limit)} (stopped reading there): more than "
            f"{ctx} can hold at up to {BYTES_PER_TOKEN} bytes per token"
        )
    return data


def read_text(prompt: str | None, prompt_file: str | None, stdin=None, *, context: int | None = None) -> str | None:
    """The user's prompt text, or None when none was given (then the demo runs). Files and
    standard input are read up to :func:`read_limit` of the model's ``context`` (tokens)."""
    if prompt is not None and prompt_file is not None:
        raise PromptError("give either --prompt or --prompt-file, not both")
    limit = read_limit(context)
    if prompt is not None:
        text = prompt
    elif prompt_file is not None:
        text = _read_file(prompt_file, stdin, limit, context)
    else:
        stdin = stdin or sys.stdin
        if stdin is None or stdin.isatty():
            return None
        text = _decode(_read_stream(stdin, limit, context), "standard input")
        if not text.strip():
            return None
    if not text.strip():
        raise PromptError("the prompt is empty")
    return text


def _read_stream(s, limit, context):
    return _read_bounded(s.buffer if hasattr(s, "buffer") else s, limit, "standard input", context)


def check_file(path: str | None, what: str = "prompt file") -> None:
    """Refuse a file that cannot be read, at once (before torch and the model load: a mistyped
    path costs a fraction of a second, not the seconds of loading); ``-`` is standard input."""
    import os

    if path in (None, "-"):
        return
    if not os.path.exists(path):
        raise PromptError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise PromptError(f"{what} is a directory: {path}")
    if not os.access(path, os.R_OK):
        raise PromptError(f"cannot read {what} {path}: Permission denied")


def check_folder(path: str | None, flag: str) -> None:
    """Refuse a file to write whose folder does not exist, at once (not after the answer)."""
    import os

    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise PromptError(f"{flag} {path}: no such directory")


def _read_file(path: str, stdin, limit: int, context: int | None) -> str:
    if path == "-":
        return _decode(_read_stream(stdin or sys.stdin, limit, context), "standard input")
    try:
        with open(path, "rb") as f:
            data = _read_bounded(f, limit, f"prompt file {path}", context)
    except FileNotFoundError:
        raise PromptError(f"prompt file not found: {path}") from None
    except IsADirectoryError:
        raise PromptError(f"prompt file is a directory: {path}") from None
    except OSError as e:
        raise PromptError(f"cannot read prompt file {path}: {e.strerror}") from None
    text = _decode(data, path)
    if not text.strip():
        raise PromptError(f"prompt file is empty: {path}")
    return text


def _decode(data, where: str) -> str:
    if isinstance(data, str):
        return data
    if b"\x00" in data[:4096]:
        raise PromptError(f"{where} is not text (binary data)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{where} is not UTF-8 text (byte {e.start})") from None


def build_ids(tokenizer, text: str, *, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of the prompt; with ``chat`` through the tokenizer's chat template. A text
    that contributes no token (a vocabulary that covers none of it) is refused."""
    ids = _ids(tokenizer, text, chat=chat, system=system)
    if len(ids) <= len(_ids(tokenizer, "", chat=chat, system=system)):
        raise PromptError(
            f"the prompt has no tokens after tokenization with {type(tokenizer).__name__} "
            "(its vocabulary covers none of the text)"
        )
    return ids


def _ids(tokenizer, text: str, *, chat: bool, system: str | None) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("--chat: this tokenizer has no chat template")
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def demo_prompt() -> tuple[str, str]:
    """(user text, system text) of the demo: the shipped document and a question about it."""
    from ..paths import demo_document

    return f"{demo_document()}\n\n{DEMO_QUESTION}", DEMO_SYSTEM


# ---------------------------------------------------------------- a document, then questions

SENTINEL = "\ue000treeattn-question\ue000"  # a private-use marker no template or text contains
SENTINEL_ANSWER = "\ue000treeattn-answer\ue000"


def _render(tokenizer, msgs) -> str:
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def _split(text: str, marker: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise PromptError("the chat template does not keep a message's text intact; use --no-chat")
    a, b = text.split(marker)
    return a, b


def document_ids(tokenizer, document: str, *, chat: bool, system: str | None = None):
    """``(ids, composition)`` of a document that questions will follow. With ``chat`` the
    document and each question form one user message: the template is rendered around a
    sentinel question and split there, so the document part is a prefix that can be cached;
    ``composition`` records what a question is then wrapped in. Without: the document's own
    tokens (special tokens included), questions follow as plain tokens."""
    if not chat:
        return build_ids(tokenizer, document, chat=False), {"kind": "raw"}
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("--chat: this tokenizer has no chat template")
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{document}\n\n{SENTINEL}"}
    ]
    prefix, suffix = _split(_render(tokenizer, msgs), SENTINEL)
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if not tokenizer(document, add_special_tokens=False)["input_ids"]:
        raise PromptError(f"the document has no tokens after tokenization with {type(tokenizer).__name__}")
    turn_between, turn_after = _split(
        _render(
            tokenizer,
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": SENTINEL_ANSWER},
                {"role": "user", "content": SENTINEL},
            ],
        ).split(SENTINEL_ANSWER, 1)[1],
        SENTINEL,
    )
    return ids, {"kind": "chat-document", "suffix": suffix, "turn_between": turn_between, "turn_after": turn_after}


def question_ids(tokenizer, question: str, composition: dict, *, next_turn: bool = False) -> list[int]:
    """Tokens of a question after the cached document (``next_turn``: after an answer kept in
    the cache, a new user turn of the conversation). Tokenized alone, without special tokens."""
    if composition.get("kind") == "chat-document":
        text = (
            (composition["turn_between"] + question + composition["turn_after"])
            if next_turn
            else question + composition["suffix"]
        )
    else:
        text = question
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not tokenizer(question, add_special_tokens=False)["input_ids"]:
        raise PromptError(f"the question has no tokens after tokenization with {type(tokenizer).__name__}")
    return ids


# ---------------------------------------------------------------- a request: its document part


def _split_tokens(tokenizer, text: str, cut: int, *, special: bool) -> tuple[list[int], int]:
    """The tokens of ``text`` exactly as a whole-text tokenization gives them, and how many of
    them lie wholly before character ``cut`` (-1: none)."""
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if cut < 0:
        return ids, 0
    n = 0
    for a, b in enc["offset_mapping"]:
        if b > cut and b > a:  # the first token that reaches past the cut (special tokens are (0, 0))
            break
        n += 1
    return ids, n


def split_completion(tokenizer, prompt: str) -> tuple[list[int], int]:
    """``(ids, d)``: the prompt's tokens as ``generate --no-chat`` makes them, and the length of
    its document part: the tokens before its last paragraph break (0: none), which a server can
    cache and later requests that start with the same text can continue."""
    cut = prompt.rfind("\n\n")
    return _split_tokens(tokenizer, prompt, cut + 2 if cut >= 0 else -1, special=True)


def split_chat(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """``(ids, d)``: the tokens of ``messages`` through the chat template (with the assistant's
    turn opened, as ``generate --chat`` tokenizes them) and the length of their document part:
    everything up to the last paragraph break of the last user message (0: none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template: use /v1/completions")
    text = _render(tokenizer, messages)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want)
    last = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    content = last.get("content") if last else None
    cut = -1
    if isinstance(content, str) and "\n\n" in content and text.rfind(content) >= 0:
        cut = text.rfind(content) + content.rfind("\n\n") + 2
    ids, d = _split_tokens(tokenizer, text, cut, special=False)
    if ids != want:  # the rendered text does not tokenize to the template's tokens: no document part
        return want, 0
    return ids, d
