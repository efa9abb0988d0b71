"""Write the book's API reference page, book/api.md, for Sphinx's autodoc.

Every public name of attnbook (each module's `__all__`) becomes a Python-domain object of
Sphinx: the page holds one autodoc directive per name (`autofunction`, `autoclass` with its
methods, `autodata`), which reads the signature and the docstring from the imported package when
the book is built, so each name is in the index and the search, and a target for {py:func}
references and for the links that sphinx-codeautolink puts on names in the chapters' code cells.
What no library knows is where the book builds each name: the section of the chapter above the
`export` cell that defines it (the nearest `# ` or `## ` heading). Each entry ends with a
`built-in` directive (book/_ext/api_sections.py) naming that section by its MyST anchor
(`myst_heading_anchors` in _config.yml), computed here exactly as myst-parser computes it; the
book is built with `-W -n`, so a link that does not resolve fails the build.

    python tools/api_reference.py [OUT]     write OUT (default book/api.md) if its text changed
    python tools/api_reference.py --check   write nothing; fail if a public name has no chapter
                                            cell defining it (tests/test_site_tools.py checks it)
    python tools/api_reference.py --check-site HTML
                                            check a built site: every public name is an object
                                            of its objects.inv with an entry on the API page that
                                            links to a chapter, and chapter code links to them

The page is generated when the book is built (`make book`, `make site-verified`, `make pdf`) and
is not committed. A chapter that is not in _toc.yml is not on the site: its names are listed
without a link.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tangle import ROOT, Chapter, public_names, read_chapters  # noqa: E402

sys.path.insert(0, str(ROOT / "book" / "_ext"))
from api_sections import use_triton_interpreter  # noqa: E402

OUT = ROOT / "book" / "api.md"
PACKAGE = "attnbook"
LONGEST_VALUE = 200  # a constant whose repr is longer is shown without its value


@dataclass(frozen=True)
class Section:
    """Where a name is built: a chapter, and the heading (None: the chapter's title) above it."""

    chapter: Chapter
    heading: str | None
    anchor: str | None

    @property
    def target(self) -> str:
        """The argument of the `built-in` directive: chapters/NN-slug[#anchor]."""
        doc = f"chapters/{self.chapter.slug}"
        return f"{doc}#{self.anchor}" if self.anchor else doc


# --- the chapters: headings, their anchors, and the export cells below them -----------------------


@functools.cache
def sphinx_config() -> dict:
    """The Sphinx configuration Jupyter Book makes from _config.yml (its defaults included)."""
    from jupyter_book.config import get_final_config

    config, _ = get_final_config(
        user_yaml=ROOT / "_config.yml", cli_config={"latex_individualpages": False},
        sourcedir=ROOT,
    )
    return config


def heading_parser(config: dict):
    """A markdown-it parser configured as the book's MyST parser."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser

    extensions = set(config.get("myst_enable_extensions", []))
    return create_md_parser(MdParserConfig(enable_extensions=extensions), RendererHTML)


def headings(md, text: str) -> list[tuple[int, str, str]]:
    """(level, title as shown, title as myst-parser slugs it) of each heading in `text`."""
    tokens = md.parse(text)
    found = []
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            inline = tokens[i + 1]
            children = inline.children or []
            slug_text = "".join(c.content for c in children if c.type in ("text", "code_inline"))
            found.append((int(token.tag[1]), inline.content.strip(), slug_text))
    return found


def export_sections(chapters: list[Chapter]) -> dict[tuple[str, str], Section]:
    """For each (module, name): the Section building it."""
    from myst_parser.mdit_to_docutils.base import default_slugify

    config = sphinx_config()
    md, depth = heading_parser(config), int(config.get("myst_heading_anchors", 0))
    sections: dict[tuple[str, str], Section] = {}
    for chapter in chapters:
        slugs: list[str] = []
        current: tuple[str | None, str | None] = (None, None)
        section_at: dict[int, tuple[str | None, str | None]] = {}  # cell index -> its section
        for index, cell in enumerate(chapter.notebook.cells):
            section_at[index] = current
            if cell.cell_type != "markdown":
                continue
            for level, title, slug_text in headings(md, cell.source):
                slug = None
                if level <= depth:  # as myst_parser's compute_unique_slug
                    slug = default_slugify(slug_text)
                    i = 1
                    while slug in slugs:
                        slug, i = f"{default_slugify(slug_text)}-{i}", i + 1
                    slugs.append(slug)
                if level == 1:
                    current = (None, None)
                elif level == 2:
                    current = (title, slug)
        for cell in chapter.export_cells():  # the tangler's own reading of the export cells
            for name in public_names(cell.source):
                sections[cell.module, name] = Section(chapter, *section_at[cell.index])
    return sections


def published_chapters() -> set[str]:
    """Chapter paths (chapters/NN-slug) that _toc.yml puts on the site."""
    files: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if "file" in node:
                files.add(str(node["file"]).removesuffix(".md").removesuffix(".ipynb"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    return files


# --- the page: one autodoc directive per public name ---------------------------------------------


def directive(module: str, name: str, obj) -> list[str]:
    """The reST that documents `module.name`: autodoc reads the object itself; a class that a
    module only gathers from another is an alias naming the class where it is documented."""
    origin = getattr(obj, "__module__", None)
    qualified = f"{PACKAGE}.{module}.{name}"
    if inspect.isclass(obj) and origin != f"{PACKAGE}.{module}":
        return [f".. py:class:: {name}", "",
                f"   The class :py:class:`{origin}.{obj.__qualname__}`, gathered here."]
    if inspect.isclass(obj):
        return [f".. autoclass:: {qualified}", "   :members:", "   :undoc-members:"]
    if callable(obj):
        return [f".. autofunction:: {qualified}"]
    value = repr(obj)
    hidden = len(value) > LONGEST_VALUE or " at 0x" in value  # too long, or not reproducible
    return [f".. autodata:: {qualified}"] + (["   :no-value:"] if hidden else [])


def find_section(sections: dict, module: str, name: str, obj) -> Section | None:
    """The section building `module.name`, or, for a name gathered from another module, the one
    building it there."""
    section = sections.get((module, name))
    if section is None:
        origin = (getattr(obj, "__module__", "") or "").removeprefix(PACKAGE + ".")
        section = sections.get((origin, name))
    return section


def generate() -> tuple[str, list[str]]:
    """The page's text, and the problems found (public names no chapter cell defines)."""
    use_triton_interpreter()
    package = importlib.import_module(PACKAGE)
    sections = export_sections(read_chapters())
    problems = []
    parts = [
        "% Generated by tools/api_reference.py when the book is built. Do not edit this file:",
        "% change the chapters (docstrings, export cells) and rebuild.",
        "",
        "# API reference",
        "",
        f"Every public name of the package `{PACKAGE}`, module by module in the order the book "
        "builds them: its signature and docstring, read from the package by Sphinx's autodoc "
        "when the book is built, and a link to the section of the chapter where it is built and "
        "checked. A name in a chapter's code cell links to its entry here.",
        "",
    ]
    for module_name in package.__all__:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        names = list(getattr(module, "__all__", []))
        rst = [f".. automodule:: {PACKAGE}.{module_name}", ""]
        if not names:
            rst += ["This module exports no names.", ""]
        for name in names:
            obj = getattr(module, name)
            section = find_section(sections, module_name, name, obj)
            if section is None:
                problems.append(f"{PACKAGE}.{module_name}.{name}: no export cell defines it")
            rst += directive(module_name, name, obj) + [""]
            if section is not None:
                rst += [f"   .. built-in:: {section.target}", ""]
        parts += [f"## `{PACKAGE}.{module_name}`", "", "```{eval-rst}", *rst[:-1], "```", ""]
    return "\n".join(parts).rstrip() + "\n", problems


# --- the built site: objects, entries and the links from chapter code ----------------------------

API_PAGE = "book/api.html"
# A name that chapter 13's code uses, and the chapter that builds it (the issue's example).
EXAMPLE = ("chapters/13-tiling.html", f"{PACKAGE}.attention.scaled_dot_product_attention",
           "chapters/01-queries-keys-values.html")


def inventory(site: Path) -> dict[str, str]:
    """objects.inv of a built site: {name: role} for the objects of the Python domain."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    found = {}
    for line in body.splitlines():
        match = re.match(r"(\S+)\s+(py:\w+)\s+-?\d+\s", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def entry_links(html: str) -> dict[str, list[str]]:
    """{object id: the hrefs of its `built-in` paragraph} on the API page."""
    links: dict[str, list[str]] = {}
    starts = list(re.finditer(r'<dt class="sig sig-object py" id="([^"]+)"', html))
    for match, after in zip(starts, starts[1:] + [None]):
        # up to the next entry with an id: an @overload's other signatures are <dt>s without one
        block = html[match.end(): after.start() if after else len(html)]
        para = re.search(r'<p class="api-built-in">(.*?)</p>', block, re.DOTALL)
        # a class's own paragraph comes before the entries of its methods
        links[match.group(1)] = re.findall(r'href="([^"]+)"', para.group(1)) if para else []
    return links


def code_links(html: str) -> set[str]:
    """The API entries that names in a page's code link to (sphinx-codeautolink's links)."""
    return {unquote(href.split("#", 1)[1]) for href in re.findall(
        r'<a class="sphinx-codeautolink-a" href="([^"]*api\.html#[^"]+)"', html)}


def check_site(site: Path) -> list[str]:
    """What is wrong with the API reference of a built site (nothing: [])."""
    use_triton_interpreter()
    package = importlib.import_module(PACKAGE)
    objects = inventory(site)
    api = (site / API_PAGE).read_text()
    entries = entry_links(api)
    published = published_chapters()
    sections = export_sections(read_chapters())
    problems = []
    for module_name in package.__all__:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        if objects.get(f"{PACKAGE}.{module_name}") != "py:module":
            problems.append(f"{PACKAGE}.{module_name} is not a py:module in objects.inv")
        for name in module.__all__:
            qualified = f"{PACKAGE}.{module_name}.{name}"
            if qualified not in objects:
                problems.append(f"{qualified} is not an object in objects.inv")
            if qualified not in entries:
                problems.append(f"{qualified} has no entry on {API_PAGE}")
                continue
            section = find_section(sections, module_name, name, getattr(module, name))
            on_site = section and f"chapters/{section.chapter.slug}" in published
            want = f"../chapters/{section.chapter.slug}.html" if on_site else None
            if want and not any(h.split("#")[0] == want for h in entries[qualified]):
                problems.append(f"{qualified}: its entry does not link to {want}")
    page, name, builder = EXAMPLE
    if name not in code_links((site / page).read_text()):
        problems.append(f"{page}: no name in its code links to the entry of {name}")
    if not any(h.startswith(f"../{builder}") for h in entries.get(name, [])):
        problems.append(f"the entry of {name} does not link to {builder}")
    chapters = sorted(site.glob("chapters/*.html"))
    linked = [p for p in chapters if code_links(p.read_text())]
    if len(linked) < len(chapters):
        unlinked = sorted(p.name for p in set(chapters) - set(linked))
        problems.append(f"no name in the code of {', '.join(unlinked)} links to the API page")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a public name has no chapter cell")
    parser.add_argument("--check-site", type=Path, metavar="HTML",
                        help="check the API page and the code links of a built site")
    args = parser.parse_args()
    if args.check_site:
        problems = check_site(args.check_site)
        for problem in problems:
            print(f"api reference: {problem}", file=sys.stderr)
        if not problems:
            print(f"api reference: {args.check_site} has every public name as a Python object, "
                  "linked to its chapter and from the chapters' code")
        return 1 if problems else 0
    text, problems = generate()
    for problem in problems:  # code/ out of date with the chapters: make check-sync says more
        print(f"api reference: {problem}", file=sys.stderr)
    if args.check:
        if not problems:
            print("api reference: every public name is built by a chapter cell")
        return 1 if problems else 0
    if not args.out.exists() or args.out.read_text() != text:
        args.out.write_text(text)
        print(f"api reference: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
