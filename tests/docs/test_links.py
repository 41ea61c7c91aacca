"""Every relative link in every Markdown file of the repository leads somewhere: the file exists,
and an anchor (`#heading`) names a heading of the file it points to, spelled as GitHub spells
anchors (lower case, punctuation dropped, spaces as hyphens, repeats numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def markdown_files() -> list[Path]:
    """The repository's own Markdown: not in a dot-folder (.tox, .venv) nor a build output."""
    skip = {"build", "dist", "node_modules", "__pycache__"}
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
    )


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives this file's headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    # explicit anchors: <a name="x"> / id="x"
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return out


def broken_links(path: Path) -> list[str]:
    out = []
    for number, line in enumerate(prose(path.read_text(encoding="utf-8")), 1):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked offline
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                out.append(f"{where}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return out


def test_the_checker_finds_a_broken_path_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Verify mode\n## Costs (per step)\n"
        "[ok](#verify-mode) [ok](#costs-per-step) [bad](#verify) [gone](missing.md)\n"
        "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = broken_links(page)
    finally:
        ROOT = saved
    assert found == [
        "page.md: (#verify): no heading #verify in page.md",
        "page.md: (missing.md): missing.md does not exist",
    ], found


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []
