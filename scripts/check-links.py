#!/usr/bin/env python3
"""Checks the relative links of the project's Markdown (run by CI).

For README.md, docs/*.md and loadtest/results/**/*.md: every relative link
`[text](path)`, `[text](path#anchor)`, `[text](#anchor)` and reference
definition `[label]: path` must name a file or directory that exists, and
an anchor into a Markdown file must match one of its headings as GitHub
makes them (lowercase, punctuation but `-` and `_` dropped, each space a
`-`, a repeated heading suffixed `-1`, `-2`, ...). Links with a scheme
(http:, https:, mailto:, ...) are skipped: no network. Code blocks and
inline code are not read.

Prints each broken link as FILE:LINE: and exits 1 if there is any.

    scripts/check-links.py            from anywhere in the repository
"""

import re
import sys
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)\s*=\s*["']([^"']+)["']""", re.I)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title"); text may hold one level of
# brackets; an image ![alt](src) is matched the same way.
INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files():
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "loadtest" / "results").rglob("*.md"))
    return [f for f in files if f.is_file()]


def prose_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            continue
        yield number, line


def heading_text(raw):
    """A heading's text as GitHub renders it: links become their text, and
    emphasis and code markers go."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = re.sub(r"<[^>]+>", "", text)
    return text


def slug(text):
    """GitHub's anchor of a heading (github-slugger)."""
    text = heading_text(text).strip().lower()
    kept = "".join(c for c in text if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


_anchors = {}


def anchors(path):
    """Every anchor of the Markdown file at `path`."""
    if path not in _anchors:
        found, seen = set(), {}
        previous = None
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            for name in HTML_ANCHOR.findall(line):
                found.add(name)
            match = HEADING.match(line)
            title = match.group(2) if match else None
            if title is None and previous and previous.strip() and SETEXT.match(line):
                if not HEADING.match(previous) and not previous.lstrip().startswith(("-", "*", "|", ">")):
                    title = previous.strip()
            previous = line
            if title is None:
                continue
            base = slug(title)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        _anchors[path] = found
    return _anchors[path]


def links(line):
    """The link targets on one line of prose, inline code removed."""
    prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
    targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    reference = REFERENCE.match(prose)
    if reference:
        targets.append(reference.group(1))
    return targets


def check(path):
    """Every broken link of `path`, as messages."""
    broken = []
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(ROOT)
    for number, line in prose_lines(text):
        for target in links(line):
            if not target or SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = urllib.parse.unquote(file_part)
            if file_part:
                base = ROOT if file_part.startswith("/") else path.parent
                resolved = (base / file_part.lstrip("/")).resolve()
                if not resolved.exists():
                    broken.append(f"{where}:{number}: {target}: no such file")
                    continue
            else:
                resolved = path
            if anchor and resolved.is_file() and resolved.suffix == ".md":
                if urllib.parse.unquote(anchor) not in anchors(resolved):
                    name = "this page" if resolved == path else resolved.relative_to(ROOT)
                    broken.append(f"{where}:{number}: {target}: no heading #{anchor} in {name}")
    return broken


def main():
    files = markdown_files()
    broken = [message for path in files for message in check(path)]
    for message in broken:
        print(message)
    if broken:
        print(f"{len(broken)} broken links in {len(files)} files")
        return 1
    print(f"links: {len(files)} files, every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
