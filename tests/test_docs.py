"""The documentation's links hold: every markdown link in README.md and docs/*.md points at a file
that exists, and every `#anchor` (on the same page or `page.md#anchor`) at a heading of that page,
slugged as GitHub slugs headings. External `http(s)://` links are not fetched. A planted tree with
a broken file link and a broken anchor shows the checker fails when it should. README.md stays a
front door: at most 250 lines, the rest in docs/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), the target optionally in <...> and followed by a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation other than `-`
    and `_` dropped, each space turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page has: its headings' slugs (a repeated one gets `-1`, `-2`, ... as on
    GitHub) and explicit `<a name=...>` / `<a id=...>` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link on a page, code left out."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            yield number, target
        reference = REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)


def broken_links(pages: list[Path], root: Path) -> list[str]:
    """Each link of `pages` that does not resolve inside `root`, as `page:line: target (why)`."""
    problems: list[str] = []
    for page in pages:
        for number, target in link_targets(page):
            why = why_broken(page, target, root)
            if why:
                problems.append(f"{page.relative_to(root)}:{number}: {target} ({why})")
    return problems


def why_broken(page: Path, target: str, root: Path) -> str | None:
    if not target:
        return "empty target"
    if EXTERNAL.match(target):
        return None  # http(s)://, mailto: ...: not fetched
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / unquote(file_part)).resolve() if file_part else page
    if not dest.is_relative_to(root.resolve()):
        return "outside the repository"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
        return f"no heading #{anchor} in {dest.relative_to(root.resolve())}"
    return None


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_every_link_in_the_readme_and_docs_resolves():
    problems = broken_links(doc_pages(ROOT), ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_catches_a_broken_file_link_and_a_broken_anchor(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "images").mkdir()
    (docs / "images" / "figure.png").write_bytes(b"\x89PNG")
    (docs / "engine.md").write_text("# The engines\n\n## Decode engine\n\n## `tandem plan`: ranking\n")
    (tmp_path / "README.md").write_text(
        "# Tandem\n\n## Quick start\n\n"
        "Good: [engine](docs/engine.md#decode-engine), [plan](docs/engine.md#tandem-plan-ranking),\n"
        "[here](#quick-start), ![figure](docs/images/figure.png), [site](https://example.com/missing).\n"
        "Broken: [gone](docs/performance.md) and [anchor](docs/engine.md#prefill-engine).\n"
        "Not links: `[code](docs/nowhere.md)`\n\n```\n[fenced](docs/nowhere.md)\n```\n"
    )
    problems = broken_links(doc_pages(tmp_path), tmp_path)
    assert problems == [
        "README.md:7: docs/performance.md (no such file)",
        "README.md:7: docs/engine.md#prefill-engine (no heading #prefill-engine in docs/engine.md)",
    ]


def test_anchors_are_slugged_as_github_slugs_them(tmp_path):
    assert slug("Speculative decoding and beam search") == "speculative-decoding-and-beam-search"
    assert slug("`tandem plan`") == "tandem-plan"
    assert slug("`POST /v1/completions`") == "post-v1completions"
    assert slug("`cluster.model`: the model") == "clustermodel-the-model"
    assert slug("Every field: honoured, refused or ignored") == "every-field-honoured-refused-or-ignored"
    assert slug("SmolLM2-135M-Instruct's real weights") == "smollm2-135m-instructs-real-weights"
    page = tmp_path / "page.md"
    page.write_text("# A\n\n## Notes\n\n```\n## Not a heading\n```\n\n## Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1"}


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move sections into docs/"
