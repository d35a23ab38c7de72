"""The documents' links lead somewhere, every page is reachable from the README, and the README stays short.

The documents are README.md, notebooks/README.md and every page under docs/. What is checked:

1. **Every relative link leads to something that exists.** A link is ``[text](target)`` or ``![alt](target)``; its
   target is a path relative to the document's folder, optionally followed by ``#anchor`` (``#anchor`` alone points
   into the document itself). The path must name a file or folder inside the repository.
2. **Every anchor into a Markdown file names one of its headings**, as GitHub makes a heading's anchor (its slug):
   the heading's text (code spans and links count as their text) lowercased, every character other than a letter,
   a digit, ``_``, ``-`` or a space dropped, each space turned into ``-``; a slug met again gets ``-1``, ``-2``, ...
   (``## The `%%autoparallel` magic`` is ``#the-autoparallel-magic``). Anchors into other files (``#L10``) are not
   checked.
3. **Links to other sites are skipped**, on purpose: a target with a scheme (``https:``, ``http:``, ``mailto:``) is
   never fetched, since the tests run without a network (:data:`EXTERNAL`).
4. Code is not text: inside fenced blocks and ``inline code``, ``[a](b)`` is not a link and ``# x`` not a heading.
5. Every page under docs/ is linked from the README, and starts with its title and one line that says what it is,
   with a link back to the README.
6. The README is under 200 lines: what nbtrain is, two commands, one notebook cell, what it runs on, the pages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # https://..., mailto:...: another site, not fetched
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\n\s*\n).)+?\1", re.S)  # inline code: never across a blank line


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", root / "notebooks" / "README.md", *sorted((root / "docs").glob("*.md"))]


# -- reading a document ----------------------------------------------------------------------------------------------

def prose(text: str) -> str:
    """``text`` with fenced blocks and inline code blanked out; every line keeps its number."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(lines))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text."""
    text = re.sub(r"(`+)(.+?)\1", r"\2", heading)               # a code span counts as its text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)        # so does a link
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def headings(text: str) -> list[str]:
    """The text of each heading of ``text`` outside fenced blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            lines.append(m.group("text"))
    return lines


def anchors(document: Path) -> set[str]:
    """The anchors of ``document``'s headings (outside code)."""
    found: dict[str, int] = {}
    names = set()
    for text in headings(document.read_text()):
        base = slug(text)
        count = found.get(base, 0)
        names.add(base if count == 0 else f"{base}-{count}")
        found[base] = count + 1
    return names


@dataclass(frozen=True)
class Link:
    document: Path
    line: int
    target: str                     # as written: "docs/errors.md#when-something-is-wrong"

    def where(self, root: Path = REPO) -> str:
        return f"{self.document.relative_to(root)}:{self.line}"


def links(document: Path) -> list[Link]:
    text = prose(document.read_text())
    return [Link(document, text.count("\n", 0, m.start()) + 1, m.group("target")) for m in LINK.finditer(text)]


def why_broken(link: Link, root: Path = REPO) -> str | None:
    """Why ``link`` leads nowhere, or None when it leads somewhere (or to another site, which is not checked)."""
    if EXTERNAL.match(link.target):
        return None
    path, _, anchor = link.target.partition("#")
    target = (link.document.parent / unquote(path)).resolve() if path else link.document
    if not target.is_relative_to(root.resolve()):
        return f"{path} is outside the repository"
    if not target.exists():
        return f"there is no {path}"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{target.relative_to(root.resolve())} has no heading whose anchor is #{anchor}"
    return None


def broken_links(document: Path, root: Path = REPO) -> list[str]:
    return [f"{link.where(root)}: ({link.target}) {why}" for link in links(document)
            if (why := why_broken(link, root)) is not None]


# -- the documents -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(document):
    assert document.is_file()
    assert broken_links(document) == []


def test_the_links_are_found():
    """A guard on the reader itself: the README links each of its pages, the pages link each other."""
    found = {document: links(document) for document in documents()}
    assert len(found[REPO / "README.md"]) >= 12
    assert all(found[d] for d in documents() if d.parent.name == "docs")


def test_every_page_under_docs_is_linked_from_the_readme():
    readme = REPO / "README.md"
    linked = {(readme.parent / link.target.partition("#")[0]).resolve() for link in links(readme)}
    unlinked = [str(page.relative_to(REPO)) for page in documents() if page.parent.name == "docs"
                and page.resolve() not in linked]
    assert unlinked == [], "pages a reader of the README cannot find"


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_page_says_what_it_is_and_links_back_to_the_readme(page):
    title, blank, first, *_ = page.read_text().splitlines()
    assert title.startswith("# ") and blank == "", "a page starts with its title"
    assert "](../README.md)" in first and len(first) <= 120, "then one line: what the page is, and the way back"


def test_the_readme_reads_in_five_minutes():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, (f"README.md has {len(lines)} lines; the reference belongs in a page under "
                                           "docs/, linked from the README")


# -- the reader itself, on documents made here -----------------------------------------------------------------------

def test_slugs_are_the_anchors_github_makes():
    assert slug("When something is wrong") == "when-something-is-wrong"
    assert slug("The `%%autoparallel` magic") == "the-autoparallel-magic"
    assert slug("Models bigger than one process: meta, pretrained weights, Hugging Face folders") == \
        "models-bigger-than-one-process-meta-pretrained-weights-hugging-face-folders"
    assert slug("Checkpoints, and resuming under another plan") == "checkpoints-and-resuming-under-another-plan"
    assert slug("dp_shard and [FSDP](https://x.org) — 2-D") == "dp_shard-and-fsdp--2-d"


def test_a_broken_link_and_a_wrong_anchor_are_found_and_nothing_else(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Run a plan\n\n## Run a plan\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Title\n"
        "[page](docs/page.md) [section](docs/page.md#run-a-plan) [again](docs/page.md#run-a-plan-1) [here](#title)\n"
        "![picture](docs/missing.png) and [a wrong\nanchor](docs/page.md#not-a-heading)\n"
        "[code heading](docs/page.md#not-a-heading-either) [outside](../elsewhere.md) [site](https://example.org/x)\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:3: (docs/missing.png) there is no docs/missing.png",
        "README.md:3: (docs/page.md#not-a-heading) docs/page.md has no heading whose anchor is #not-a-heading",
        "README.md:5: (docs/page.md#not-a-heading-either) docs/page.md has no heading whose anchor is "
        "#not-a-heading-either",
        "README.md:5: (../elsewhere.md) ../elsewhere.md is outside the repository",
    ]
