"""The documentation holds together: every relative link resolves, the reference names every command
line option, and the repository cites nothing outside itself.

* Every relative link of README.md, docs/*.md and benchmarks/*.md — inline links, images and
  reference definitions, outside code — points to a file or directory inside the repository, and a
  ``#anchor`` into a Markdown file names one of its headings (GitHub's heading ids) or an explicit
  ``<a id=…>``/``<a name=…>``.
* docs/cli.md names every command and every option that ``osdn_diag.cli.build_parser`` defines.
* No file of the repository (``.git`` aside) mentions the design document that lives outside it, or a
  path into the shared folder beside the repository: the repository must stand alone.

Pure text processing (and one argparse parser): well under a second.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
# Spelled in two parts so that this file does not mention them itself.
OUTSIDE_REFERENCES = ("DESIGN" + ".md", ".." + "/shared")

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](dest) and ![alt](dest); dest optionally in <…>, optionally followed by a "title".
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_lines(text: str, *, blank_code: bool = True):
    """``(line number, line)`` outside fenced code blocks, with code spans blanked (``blank_code``)."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is None:
            yield number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) if blank_code else line


def links(path: Path) -> list[tuple[int, str]]:
    """Every link destination of a Markdown file, with its line number."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _INLINE.finditer(line):
            found.append((number, match.group(1)))
        ref = _REFERENCE.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return [(n, d[1:-1] if d.startswith("<") and d.endswith(">") else d) for n, d in found]


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text (Markdown syntax removed), lower-cased, with everything but
    letters, marks, digits, connector punctuation, spaces and hyphens dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    kept = (ch for ch in text.lower()
            if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids a Markdown file's headings get (a repeated one gets -1, -2, … as on GitHub), and its
    explicit HTML anchors."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in _prose_lines(text, blank_code=False):
        match = _ATX.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    ids.update(m.group(1) for m in _HTML_ANCHOR.finditer(text))
    return ids


def link_problem(source: Path, dest: str) -> str | None:
    """What is wrong with the link ``dest`` in ``source`` (``None``: nothing, or not a relative link)."""
    if _SCHEME.match(dest) or dest.startswith("//"):
        return None  # http:, https:, mailto:, … — not checked here
    target, _, fragment = dest.partition("#")
    path = (source.parent / unquote(target)).resolve() if target else source
    try:
        path.relative_to(ROOT)
    except ValueError:
        return f"{dest}: points outside the repository"
    if not path.exists():
        return f"{dest}: no such file or directory"
    if fragment and path.suffix == ".md" and unquote(fragment) not in anchors(path):
        return f"{dest}: {path.relative_to(ROOT)} has no heading or anchor #{fragment}"
    return None


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = [f"{path.relative_to(ROOT)}:{n}: {msg}" for n, dest in links(path)
                if (msg := link_problem(path, dest)) is not None]
    assert not problems, "\n".join(problems)


def test_the_link_checker_sees_links_and_headings():
    # Against a vacuous pass: the reference pages do link to each other, and their headings are read.
    index = ROOT / "docs" / "README.md"
    assert {dest for _, dest in links(index)} >= {"cli.md", "run-directory.md", "metrics.md"}
    assert {"run", "prompts---prompts-p", "several-processes-torchrun"} <= anchors(ROOT / "docs" / "cli.md")
    assert slug("Comparator gap and Theorem D.7") == "comparator-gap-and-theorem-d7"
    assert slug("`--overwrite`") == "--overwrite"
    assert link_problem(index, "cli.md#no-such-heading") is not None
    assert link_problem(index, "no-such-page.md") is not None
    assert link_problem(index, "cli.md#run") is None


def _parser_names():
    """Every command and every option string the command line defines."""
    from osdn_diag.cli import build_parser

    parser = build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    commands = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands[name] = {s for a in sub._actions for s in a.option_strings}
    return options - {"-h", "--help"}, {n: o - {"-h", "--help"} for n, o in commands.items()}


def test_cli_reference_names_every_command_and_option():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    headings = anchors(ROOT / "docs" / "cli.md")
    top, commands = _parser_names()
    assert len(commands) >= 7
    missing = [f"command {name!r} (a heading `{name}`)" for name in commands if name not in headings]
    for owner, options in [("osdn-diag", top), *commands.items()]:
        for option in sorted(options):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                missing.append(f"{owner} {option}")
    assert not missing, "docs/cli.md does not describe: " + ", ".join(missing)


def _repository_files() -> list[Path]:
    """The repository's files: git's tracked and untracked-but-not-ignored files where git can say,
    else every file under the root but ``.git`` and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
        if files:
            return [f for f in files if f.is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
    found = []
    for directory, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found += [Path(directory) / n for n in names]
    return found


def test_nothing_cites_what_lies_outside_the_repository():
    files = _repository_files()
    assert Path(__file__).resolve() in {f.resolve() for f in files}
    offenders = []
    for path in files:
        data = path.read_bytes()
        for needle in OUTSIDE_REFERENCES:
            if needle.encode() in data:
                offenders.append(f"{path.relative_to(ROOT)} mentions {needle}")
    assert not offenders, "the repository must stand alone:\n" + "\n".join(offenders)
