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
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "treeattn"
    )
    return Path(base)


def demo_document() -> str:
    """The long document shipped with treeattn (written for the project; Apache-2.0)."""
    return resources.files("treeattn_cli").joinpath("data/demo_document.txt").read_text("utf-8")


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it while it reads, a
    race with any other thread creating files): Linux reports it in ``/proc/self/status``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def temp_beside(path, suffix: str = "") -> str:
    """A new empty file in ``path``'s directory for an atomic write, with the permissions a plain
    ``open(path, "w")`` would give it (``mkstemp`` makes it 0600: a file shared with a team
    would be private to its writer)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".treeattn-", suffix=suffix, dir=os.path.dirname(os.path.abspath(path)))
    os.fchmod(fd, 0o666 & ~umask())
    os.close(fd)
    return tmp


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename;
    the file gets the permissions the umask gives, as ``open()`` would."""
    tmp = temp_beside(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
