"""The documentation's rules, each failure naming the file, the line and the rule: no page under docs/ over 300 lines
(benchmarks/README.md: 150), no sentence of docs/ over 60 words, every relative link between the docs, README.md and
benchmarks/ resolving (files and #anchors as GitHub renders them), and none of the benchmark machines' own words
(calls, leases) in the product.

A sentence: prose outside code blocks and table rows, a paragraph or list item joined across its lines and split
after `.`, `!` or `?` where the next word starts a sentence; an inline code span or a link counts as one word.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md"))
LINKED = [*DOCS, REPO / "README.md", *sorted((REPO / "benchmarks").rglob("*.md"))]
MAX_LINES = {**{path: 300 for path in DOCS}, REPO / "benchmarks/README.md": 150}
MAX_WORDS = 60
# The benchmark machines' habits (a command run on a lent machine, its lease) are not the product's words.
MACHINE_WORDS = re.compile(r"device machine|one call|the call's|next call|\blease", re.I)
PRODUCT = ["docs", "benchmarks", "README.md", "src"]
NOT_PROSE = ("benchmarks/results/", "src/model_utils/assets/")  # measured records; the tokenizer's vocabulary


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def prose_lines(path: Path):
    """(line number, text) of the lines outside code blocks: fenced, or indented by four spaces after a blank line."""
    fenced = indented = False
    previous = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.strip():
            indented = line.startswith("    ") and (indented or not previous.strip())
            if not indented:
                yield number, line
        elif not fenced:
            yield number, line
        previous = line


BLOCK_START = re.compile(r"^\s*(#+ |[-*+] |\d+\. |\||<|!\[)")


def paragraphs(path: Path):
    """(first line number, text) of each paragraph, list item and heading; table rows and HTML are left out."""
    start, parts = None, []
    for number, line in [*prose_lines(path), (None, "")]:
        new_block = not line.strip() or BLOCK_START.match(line)
        if new_block and parts:
            yield start, " ".join(parts)
            start, parts = None, []
        if not line.strip() or line.lstrip().startswith(("|", "<", "![")):
            continue
        if start is None:
            start = number
        parts.append(line.strip())


CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[\"*_])")


def sentences(text: str) -> list[str]:
    text = LINK.sub(lambda m: "Link", CODE_SPAN.sub("Code", text))  # one word; may start a sentence
    text = re.sub(r"\b(e\.g|i\.e|etc|vs|cf)\.", r"\1", text)  # abbreviations end no sentence
    return [s for s in SENTENCE_END.split(re.sub(r"^\s*(#+|[-*+]|\d+\.)\s+", "", text)) if s.strip()]


@pytest.mark.parametrize("path", sorted(MAX_LINES), ids=rel)
def test_no_page_is_too_long(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES[path], f"{rel(path)}:{lines}: {lines} lines, over the {MAX_LINES[path]}-line limit: " \
                                     "split it by topic or make it shorter"


def test_no_sentence_in_docs_is_over_60_words():
    long = []
    for path in DOCS:
        for number, text in paragraphs(path):
            for sentence in sentences(text):
                words = len(sentence.split())
                if words > MAX_WORDS:
                    long.append(f"{rel(path)}:{number}: a sentence of {words} words (at most {MAX_WORDS}): "
                                f"{sentence[:100]}...")
    assert not long, "split these into shorter sentences, one idea each:\n" + "\n".join(long)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = LINK.sub(lambda m: m.group(1), heading.strip()).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in prose_lines(path):
        match = re.match(r"^#+\s+(.*?)\s*#*\s*$", line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_resolves():
    broken = []
    for path in LINKED:
        for number, line in prose_lines(path):
            for target in MARKDOWN_LINK.findall(CODE_SPAN.sub("", line)):
                if re.match(r"^[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                resolved = (path.parent / file).resolve() if file else path
                if not resolved.exists():
                    broken.append(f"{rel(path)}:{number}: links to {target}: no file {file}")
                elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    broken.append(f"{rel(path)}:{number}: links to {target}: {rel(resolved)} has no heading "
                                  f"#{anchor}")
    assert not broken, "fix these links:\n" + "\n".join(broken)


def test_the_product_does_not_speak_of_the_benchmark_machines_habits():
    found = []
    for top in PRODUCT:
        root = REPO / top
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            name = rel(path)
            if name.startswith(NOT_PROSE) or "__pycache__" in name:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:  # images
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if match := MACHINE_WORDS.search(line):
                    found.append(f"{name}:{number}: '{match.group(0)}' (a benchmark machine's habit, not the "
                                 f"product's): {line.strip()[:100]}")
    assert not found, "state what the product does instead:\n" + "\n".join(found)
