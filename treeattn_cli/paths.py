"""Where treeattn keeps and finds its files: the cache directory, the shipped demo document, and
atomic writes (a reader never sees half a file)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def cache_root() -> Path:
    """``$TREEATTN_CACHE``, else ``$XDG_CACHE_HOME/treeattn``, else ``~/.cache/treeattn``:
    converted models, kernel verdicts, model probes, the server's document cache."""
    base = os.environ.get("TREEATTN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "treeattn")
    return Path(base)


def demo_document() -> str:
    """The long document shipped with treeattn (written for the project; Apache-2.0)."""
    return resources.files("treeattn_cli").joinpath("data/demo_document.txt").read_text("utf-8")


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".treeattn-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
