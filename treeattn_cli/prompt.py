"""The prompt: from --prompt, --prompt-file, standard input, or the shipped demo document;
optionally through the tokenizer's chat template. Errors are one-line :class:`PromptError`."""

from __future__ import annotations

import sys
from importlib import resources

DEMO_QUESTION = ("According to the report above, who repaired the east telescope's drive "
                 "motor in 1962, and what did they use to replace the broken gear?")
DEMO_SYSTEM = "You are a careful assistant. Answer from the document, briefly."


class PromptError(ValueError):
    """A prompt that cannot be used; the message is one line for the user."""


def demo_document() -> str:
    """The long document shipped with treeattn (written for the project; Apache-2.0)."""
    return resources.files("treeattn_cli").joinpath("data/demo_document.txt").read_text("utf-8")


def read_text(prompt: str | None, prompt_file: str | None, stdin=None) -> str | None:
    """The user's prompt text, or None when none was given (then the demo runs)."""
    if prompt is not None and prompt_file is not None:
        raise PromptError("give either --prompt or --prompt-file, not both")
    if prompt is not None:
        text = prompt
    elif prompt_file is not None:
        text = _read_file(prompt_file, stdin)
    else:
        stdin = stdin or sys.stdin
        if stdin is None or stdin.isatty():
            return None
        text = _decode(stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read(), "standard input")
        if not text.strip():
            return None
    if not text.strip():
        raise PromptError("the prompt is empty")
    return text


def _read_file(path: str, stdin) -> str:
    if path == "-":
        s = stdin or sys.stdin
        return _decode(s.buffer.read() if hasattr(s, "buffer") else s.read(), "standard input")
    try:
        with open(path, "rb") as f:
            data = f.read()
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
    """Token ids of the prompt; with ``chat`` through the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("--chat: this tokenizer has no chat template")
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def demo_prompt() -> tuple[str, str]:
    """(user text, system text) of the demo: the shipped document and a question about it."""
    return f"{demo_document()}\n\n{DEMO_QUESTION}", DEMO_SYSTEM
