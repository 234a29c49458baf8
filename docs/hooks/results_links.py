"""Included material that stays correct where it lands: benchmark result files and sections of generated pages.

A result file is written by its benchmark and included into a page with pymdownx.snippets
(``--8<-- "docs/results/NAME.md"``); it is not a page of its own, so that each figure appears once.
Its links name sibling files (``[kernel_audit.md](kernel_audit.md)``, ``![...](plot.png)``), which
resolve against the including page's folder. This hook rewrites such a link after the snippets are
expanded: to the page that includes that result file, or to the file itself under ``results/``.

A page may also take one section of a generated reference page, written once from the code, with
``<!-- include-section: reference/options.md#Bytes per parameter -->`` (a path under ``docs/`` and
a heading's text): the section's body, without its heading, up to the next heading of its level or
above, its relative links rewritten for the including page. A missing file or heading is an error.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from markdown import Extension
from markdown.preprocessors import Preprocessor

INCLUDE = re.compile(r'--8<--\s+"docs/results/([^"]+\.md)"')
LINK_TARGET = re.compile(r"(\]\()([^)/\s#]+)(#[^)\s]*)?(\))")
SECTION = re.compile(r"^<!-- include-section: (?P<path>[^#]+)#(?P<heading>.+?) -->$", re.M)
HEADING = re.compile(r"^(#+) (.*)$")
RELATIVE_LINK = re.compile(r"(\]\()(?![a-z]+://|#|/)([^)\s]+)(\))")

_docs_dir = Path()
_includers: dict[str, str] = {}
_current_page = ""


def _relative(target: str, page: str) -> str:
    return os.path.relpath(target, os.path.dirname(page) or ".").replace(os.sep, "/")


class _ResultLinks(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        results = _docs_dir / "results"
        page_dir = (_docs_dir / _current_page).parent

        def rewrite(match: re.Match) -> str:
            name, anchor = match[2], match[3] or ""
            if (page_dir / name).exists() or not (results / name).exists():
                return match[0]
            if name.endswith(".md"):
                includer = _includers.get(name)
                if includer is None:
                    return match[0]
                target = _relative(includer, _current_page)
            else:
                target = _relative(f"results/{name}", _current_page)
            return f"{match[1]}{target}{anchor}{match[4]}"

        return [LINK_TARGET.sub(rewrite, line) for line in lines]


class _ResultLinksExtension(Extension):
    def extendMarkdown(self, md) -> None:  # noqa: N802 (Markdown's name)
        md.preprocessors.register(_ResultLinks(md), "lowprec_result_links", 5)


def on_config(config):
    global _docs_dir
    _docs_dir = Path(config["docs_dir"])
    _includers.clear()
    for page in sorted(_docs_dir.rglob("*.md")):
        if page.parent.name == "results":
            continue
        for name in INCLUDE.findall(page.read_text(encoding="utf-8")):
            _includers.setdefault(name, page.relative_to(_docs_dir).as_posix())
    config["markdown_extensions"].append(_ResultLinksExtension())
    return config


def _section(path: str, heading: str, page: str) -> str:
    lines = (_docs_dir / path).read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if (m := HEADING.match(line)) and m[2].strip() == heading]
    if not starts:
        raise ValueError(f"{page}: no heading {heading!r} in {path} to include")
    level = len(HEADING.match(lines[starts[0]])[1])
    body = []
    for line in lines[starts[0] + 1:]:
        m = HEADING.match(line)
        if m and len(m[1]) <= level:
            break
        body.append(line)

    def relink(match: re.Match) -> str:
        target = os.path.normpath(os.path.join(os.path.dirname(path), match[2]))
        return f"{match[1]}{_relative(target, page)}{match[3]}"

    return "\n".join(RELATIVE_LINK.sub(relink, line) for line in body).strip("\n")


def on_page_markdown(markdown, page, config, files):
    global _current_page
    _current_page = page.file.src_uri
    return SECTION.sub(lambda m: _section(m["path"].strip(), m["heading"].strip(), _current_page), markdown)
