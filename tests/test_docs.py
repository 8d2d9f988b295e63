"""The documentation's commands and links (issue 54): every ``treeattn <command> --flag`` that
README.md, BENCHMARKS.md and docs/*.md show exists in that command's ``--help``, every ``make``
target and ``python -m`` module they name exists, and every relative link (with its ``#anchor``)
points to a file and a heading that exist. Fast: no model, no ranks; ``--help`` comes from the
Typer app in this process."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
COMMANDS = ("generate", "chat", "serve", "topo", "bench", "check")
SHELL = {"bash", "sh", "shell", "console"}

FENCE = re.compile(r"^\s*```(\S*)\s*$")
TREEATTN = re.compile(r"(?<![\w./-])treeattn\)?\s+([a-z][\w-]*)")  # also `$(which treeattn) generate`
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"`([^`]+)`")


def _split(path: Path):
    """(prose, [(language, lines of the block)]) of a markdown file: fenced blocks apart."""
    prose, blocks, lang, block = [], [], None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and lang is None:
            lang, block = m.group(1).lower(), []
        elif m and not m.group(1):
            blocks.append((lang, block))
            lang = None
        elif lang is not None:
            block.append(line)
        else:
            prose.append(line)
    assert lang is None, f"{path.name}: a code block is not closed"
    return "\n".join(prose), blocks


def _shell_lines(path: Path):
    """The logical lines of the file's shell blocks: continuations joined, prompts and comments off."""
    out = []
    for lang, block in _split(path)[1]:
        if lang not in SHELL:
            continue
        joined = "\n".join(block).replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"^\s*\$ ", "", line)
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def _inline_commands(path: Path):
    """`treeattn <command> ...` written inline in the prose (may run over a line break)."""
    prose = _split(path)[0]
    return [" ".join(span.split()) for span in INLINE.findall(prose) if TREEATTN.match(span.strip())]


@lru_cache(maxsize=None)
def _help_flags(command: str) -> frozenset:
    """The flags ``treeattn <command> --help`` lists (its options column, one option a line)."""
    from typer.testing import CliRunner

    from treeattn_cli.main import app

    r = CliRunner().invoke(app, [command, "--help"], terminal_width=200, max_content_width=200)
    assert r.exit_code == 0, r.output
    flags = set()
    for line in r.output.split("Options:", 1)[1].splitlines():
        if line.lstrip().startswith("-"):
            flags.update(FLAG.findall(re.split(r"\s{2,}", line.strip())[0]))
    assert "--help" in flags, r.output
    return frozenset(flags)


def _uses(text: str):
    """(command, [flags]) for each `treeattn <command>` in a shell line or an inline span."""
    found = []
    for segment in re.split(r"\|\||&&|[|;]", text):
        m = TREEATTN.search(segment)
        if m:
            found.append((m.group(1), FLAG.findall(segment[m.end() :])))
    return found


def _command_problems(path: Path):
    problems, seen = [], set()
    for text in _shell_lines(path) + _inline_commands(path):
        for command, flags in _uses(text):
            seen.add(command)
            if command not in COMMANDS:
                problems.append(f"{path.name}: `treeattn {command}` is not a command: {text}")
                continue
            for flag in flags:
                if flag not in _help_flags(command):
                    problems.append(f"{path.name}: `treeattn {command}` has no {flag}: {text}")
    return problems, seen


def test_documented_commands_use_flags_their_help_lists():
    problems, seen = [], set()
    for path in DOCS:
        if path.name == "benchmarks-history.md":  # the diary: what was run on its day
            continue
        p, s = _command_problems(path)
        problems += p
        seen |= s
    assert not problems, "\n".join(problems)
    assert set(COMMANDS) <= seen, f"commands no doc shows: {set(COMMANDS) - seen}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_documented(command):
    """docs/usage.md describes every flag of every command but serve's, docs/serving.md serve's."""
    page = REPO / "docs" / ("serving.md" if command == "serve" else "usage.md")
    text = page.read_text(encoding="utf-8")
    missing = sorted(
        f
        for f in _help_flags(command) - {"--help"}
        if not re.search(re.escape(f) + r"(?![\w-])", text) and not (f.startswith("--no-") and "--" + f[5:] in text)
    )
    assert not missing, f"{page.name} does not mention treeattn {command}'s {missing}"


def test_the_check_catches_a_wrong_flag(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text(
        "```bash\ntreeattn chat --prompt-file a.txt \\\n    --questionz q.txt   # one typo\n```\n"
        "and inline, `treeattn generate --no-such-flag`.\n"
    )
    problems, _ = _command_problems(doc)
    assert len(problems) == 2 and "--questionz" in problems[0] and "--no-such-flag" in problems[1], problems


def _targets():
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M))


def test_make_targets_and_python_modules_named_in_the_docs_exist():
    targets, problems = _targets(), []
    for path in DOCS:
        for line in _shell_lines(path):
            for segment in re.split(r"\|\||&&|[|;]", line):
                words = segment.split()
                if words[:1] == ["make"]:
                    for word in words[1:]:
                        if "=" not in word and not word.startswith("-") and word not in targets:
                            problems.append(f"{path.name}: no make target {word!r}: {line}")
        for module in re.findall(r"python3? -m (treeattn_(?:cli|kernels)[\w.]*)", path.read_text(encoding="utf-8")):
            parts = module.split(".")
            root = REPO / ("kernels" if parts[0] == "treeattn_kernels" else "treeattn_cli")
            where = root.joinpath(*parts[1:])
            if not (where.with_suffix(".py").is_file() or (where / "__main__.py").is_file()):
                problems.append(f"{path.name}: no module {module}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset:
    anchors, counts = set(), {}
    for line in _split(path)[0].splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return frozenset(anchors)


def test_slug_is_githubs():
    assert (
        slug("One document, many questions: `treeattn chat` and saved caches")
        == "one-document-many-questions-treeattn-chat-and-saved-caches"
    )
    assert slug("7. Tests and measurements") == "7-tests-and-measurements"
    assert slug("Contexts that do not fit: `--kv-dtype fp8`") == "contexts-that-do-not-fit---kv-dtype-fp8"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_to_files_and_headings_that_exist(path):
    problems = []
    prose = re.sub(r"`[^`]*`", "", _split(path)[0])
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_readme_is_a_landing_page():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "make test   # the test suite" in text  # .ci/run runs the README's test command
    assert "make demo" in text
