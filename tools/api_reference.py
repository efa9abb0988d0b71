"""Write the book's API reference page from the package and the chapters.

Every public name of attnbook (each module's `__all__`) is listed with its signature and its
docstring, read from the imported package (`inspect.signature`, `inspect.getdoc`), and with a
link to the section of the chapter that builds it: the nearest `# ` or `## ` heading above the
`export` cell that defines the name. The link uses the heading's MyST anchor
(`myst_heading_anchors` in _config.yml), computed here exactly as myst-parser computes it; the
book is built with `-W -n`, so a link that does not resolve fails the build.

    python tools/api_reference.py [OUT]     write OUT (default book/api.md) if its text changed
    python tools/api_reference.py --check   write nothing; fail if a public name has no chapter
                                            cell defining it (tests/test_site_tools.py checks it)

The page is generated when the book is built (`make book`, `make site-verified`) and is not
committed. A chapter that is not in _toc.yml is not on the site: its names are listed without
a link.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tangle import ROOT, Chapter, public_names, read_chapters  # noqa: E402

OUT = ROOT / "book" / "api.md"
PACKAGE = "attnbook"


@dataclass(frozen=True)
class Section:
    """Where a name is built: a chapter, and the heading (None: the chapter's title) above it."""

    chapter: Chapter
    heading: str | None
    anchor: str | None


# --- the chapters: headings, their anchors, and the export cells below them -----------------------


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


def assigned_source(source: str, name: str) -> str | None:
    """The right-hand side of `name = ...` in an export cell, as source text."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.unparse(node.value)
    return None


def export_sections(chapters: list[Chapter]) -> tuple[dict, dict]:
    """For each (module, name): the Section building it, and the export cell's source."""
    from myst_parser.mdit_to_docutils.base import default_slugify

    config = sphinx_config()
    md, depth = heading_parser(config), int(config.get("myst_heading_anchors", 0))
    sections: dict[tuple[str, str], Section] = {}
    sources: dict[tuple[str, str], str] = {}
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
                sources[cell.module, name] = cell.source
    return sections, sources


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


# --- markdown ----------------------------------------------------------------------------------

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_SPECIAL = re.compile(r"([\\*_\[\]<>{}$#|~!])")


def escape(text: str) -> str:
    """Markdown for plain text: every character markdown or MyST would read as syntax escaped,
    except inside `code spans`, which stay code."""
    out, pos = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_SPECIAL.sub(r"\\\1", text[pos : match.start()]))
        out.append(match.group(0))
        pos = match.end()
    out.append(_SPECIAL.sub(r"\\\1", text[pos:]))
    return "".join(out)


def docstring_markdown(doc: str) -> str:
    """A docstring as markdown: paragraphs of prose (escaped), indented or `>>>` blocks as code."""
    blocks = []
    for paragraph in re.split(r"\n\s*\n", doc.strip()):
        lines = paragraph.splitlines()
        if all(line.startswith("    ") for line in lines) or lines[0].lstrip().startswith(">>>"):
            code = inspect.cleandoc("\n".join(lines)) if lines[0].startswith(" ") else paragraph
            blocks.append(f"```python\n{code}\n```")
            continue
        text = []
        for line in lines:
            line = escape(line)
            if re.fullmatch(r"\s*[-=+:]+\s*", line) or re.match(r"\s*[:+]", line):
                line = "\\" + line.lstrip()  # no setext underline, thematic break or deflist
            text.append(line)
        blocks.append("\n".join(text))
    return "\n\n".join(blocks)


def first_paragraph(doc: str) -> str:
    return " ".join(re.split(r"\n\s*\n", doc.strip())[0].split())


def signature(name: str, obj, prefix: str = "", width: int = 72) -> str:
    """`prefix name(params) -> ret`, one parameter a line when it is longer than `width`."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{prefix}{name}(...)"
    if inspect.isclass(obj):
        sig = sig.replace(return_annotation=sig.empty)
    text = f"{prefix}{name}{sig}"
    if len(text) <= width or not sig.parameters:
        return text
    params, previous = [], None
    for p in sig.parameters.values():  # the markers / and * where inspect puts them
        if previous is p.POSITIONAL_ONLY and p.kind is not p.POSITIONAL_ONLY:
            params.append("/")
        if p.kind is p.KEYWORD_ONLY and previous not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL):
            params.append("*")
        params.append(str(p))
        previous = p.kind
    if previous is inspect.Parameter.POSITIONAL_ONLY:
        params.append("/")
    ret = sig.return_annotation
    ret = "" if ret is sig.empty else f" -> {inspect.formatannotation(ret)}"
    return f"{prefix}{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


def methods(cls) -> list[tuple[str, object, str]]:
    """Public methods and properties the class itself defines, in source order: (name, the
    member as called on an instance, its own docstring, not one inherited)."""
    found = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, staticmethod):
            found.append((name, member.__func__, member.__func__.__doc__))
        elif isinstance(member, classmethod) or inspect.isfunction(member):
            func = getattr(member, "__func__", member)
            found.append((name, _without_first(func), func.__doc__))
        elif isinstance(member, property):
            found.append((name, member, member.__doc__))
    return found


def _without_first(func):
    """`func` as seen bound: its signature without `self` or `cls`."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return func
    params = list(sig.parameters.values())[1:]
    bound = lambda: None  # noqa: E731 (a carrier for the signature)
    bound.__signature__ = sig.replace(parameters=params)
    return bound


def inline(markdown: str) -> str:
    """A chapter's title or heading for this page: as written (math stays math), unless it uses
    a role such as {glue:text}, which means something only on its own page."""
    return escape(markdown) if "{" in markdown else markdown


def section_link(section: Section | None, published: set[str]) -> str:
    if section is None:
        return "(no chapter cell defines it)"
    chapter = section.chapter
    doc = f"chapters/{chapter.slug}"
    where = inline(chapter.title) + (f", *{inline(section.heading)}*" if section.heading else "")
    if doc not in published:
        return f"{where} ({chapter.relpath}, not yet on this site)"
    target = f"../{doc}.md" + (f"#{section.anchor}" if section.anchor else "")
    return f"[{where}]({target})"


def entry(module: str, name: str, obj, section, source, published: set[str]) -> str:
    lines = [f"({label(module, name)})=", f"### `{name}`", ""]
    if inspect.isclass(obj):
        code = signature(name, obj, "class ")
    elif callable(obj):
        code = signature(name, obj, "def ")
    else:
        value = assigned_source(source, name) if source else None
        code = f"{name} = {value if value and len(value) <= 200 else repr(obj)[:200]}"
    lines += ["```python", code, "```", ""]
    if not (inspect.isclass(obj) or callable(obj)) and code != f"{name} = {obj!r}":
        lines += [f"When this page was built: `{name} = {obj!r}`"[:300], ""]
    doc = inspect.getdoc(obj) if (inspect.isclass(obj) or callable(obj)) else None
    if doc:
        lines += [docstring_markdown(doc), ""]
    if inspect.isclass(obj):
        members = methods(obj)
        if members:
            lines.append("Methods:")
            lines.append("")
            for mname, member, mdoc in members:
                if isinstance(member, property):
                    head = f"`{mname}` (property)"
                else:
                    head = f"`{signature(mname, member, width=10**6)}`"
                summary = escape(first_paragraph(inspect.cleandoc(mdoc))) if mdoc else ""
                lines.append(f"- {head}" + (f": {summary}" if summary else ""))
            lines.append("")
    lines += [f"Built in {section_link(section, published)}: `from {PACKAGE}.{module} "
              f"import {name}`", ""]
    return "\n".join(lines)


def label(module: str, name: str) -> str:
    return f"api-{module}-{name}".lower().replace("_", "-")


def generate() -> tuple[str, list[str]]:
    """The page's text, and the problems found (public names no chapter cell defines)."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    package = importlib.import_module(PACKAGE)
    chapters = read_chapters()
    sections, sources = export_sections(chapters)
    published = published_chapters()
    problems = []
    parts = [
        "% Generated by tools/api_reference.py when the book is built. Do not edit this file:",
        "% change the chapters (docstrings, export cells) and rebuild.",
        "",
        "# API reference",
        "",
        f"Every public name of the package `{PACKAGE}` (version {package.__version__}), module by "
        "module in the order the book builds them, with its signature and docstring as the "
        "installed package has them, and a link to the section of the chapter where it is built "
        "and checked. The page is generated from the package and the chapters each time the "
        "book is built.",
        "",
    ]
    for module_name in package.__all__:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        summary = first_paragraph(inspect.getdoc(module) or module_name).rstrip(".")
        parts += [f"## `{PACKAGE}.{module_name}`: {escape(summary)}", ""]
        names = list(getattr(module, "__all__", []))
        if not names:
            parts += ["This module exports no names.", ""]
        for name in names:
            obj = getattr(module, name)
            key = (module_name, name)
            section = sections.get(key)
            if section is None:
                origin = getattr(obj, "__module__", "") or ""
                key = (origin.removeprefix(PACKAGE + "."), name)
                section = sections.get(key)
            if section is None:
                problems.append(f"{PACKAGE}.{module_name}.{name}: no export cell defines it")
            parts.append(entry(module_name, name, obj, section, sources.get(key), published))
    return "\n".join(parts).rstrip() + "\n", problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a public name has no chapter cell")
    args = parser.parse_args()
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
