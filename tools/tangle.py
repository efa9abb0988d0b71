"""Tangle the book: chapters/*.md -> code/attnbook/*.py and notebooks/*.ipynb.

A chapter is a MyST Markdown notebook. Its front matter names the module it owns (`attnbook:
{module: attention}`), and every code cell tagged `export` goes, in order, into
`code/attnbook/<module>.py`. A chapter split in two continues its first half's module with
`attnbook: {continues: [<module>]}`. A cell tagged `export:<name>` goes into
`code/attnbook/<name>.py` instead, for the rare chapter that owns a second module; `attnbook:
{describe: {<name>: ...}}` gives a module its one-line docstring (a second module must have one;
the chapter's own module defaults to the chapter's title), and `attnbook: {main: {<name>:
<function>}}` makes `python -m attnbook.<name>` call that function. A module starts with
`__all__`, and each of its cells follows a comment naming the chapter file and the section the
cell sits in, so that any generated line leads back to the prose that explains it. A cell whose
first line is `# continues <Class>` adds methods to a class an earlier cell of the module defines:
in the chapter it defines functions and attaches them (`Class.f = f`); in the module they go into
the class's body and the attaching lines are left out; a cell that would behave otherwise there
is refused (CONTRIBUTING.md, "Writing a chapter").
The same chapter becomes `notebooks/<chapter>.ipynb`:
its cells behind one setup cell that, on Colab only, installs the package from the repository named in
`_config.yml`, at the branch named there (main): a notebook on main installs the package of main.
The site offers its own copies of the notebooks, which CI pins to the commit it publishes.

    python tools/tangle.py              write code/ and the notebooks' sources (keeps outputs)
    python tools/tangle.py --execute    ... and run every notebook whose code changed, or
                                        that ran another version of a module it runs
    python tools/tangle.py --check      fail if code/ or notebooks/ differ from the chapters
    python tools/tangle.py --pin SHA NOTEBOOK...   make copies of notebooks install commit SHA

The notebooks' text cells are plain Markdown, for Colab and Jupyter, which do not know MyST: a
glossary term shows as its text, a citation as (Author et al., year) from book/references.bib, a
dropdown admonition as an HTML <details>, and a glued number as the value the notebook's own
outputs hold, formatted as on the site.

An executed notebook records in its metadata (`attnbook: {package: <digest>}`) a digest of the
modules it runs: those its code cells import and, in turn, theirs. `--execute` runs it again when
the chapters now write those modules otherwise, so a change to a module re-executes every chapter
that uses it, not only the one that writes it.

The output depends only on the chapters, `_config.yml`, `pyproject.toml`, `book/references.bib`
and the notebooks' outputs, not on git: running it twice gives the same bytes, and a commit needs
no second commit to follow it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import functools
import hashlib
import io
import re
import sys
import textwrap
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

# jsonschema, which nbformat imports, compiles 38 grammars for IRI formats at import when
# rfc3987_syntax is installed (JupyterLab's dependencies bring it): a third of a run's time, for
# formats no notebook has. Marked missing here, jsonschema leaves those formats unchecked.
sys.modules.setdefault("rfc3987_syntax", None)
import nbformat  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
PACKAGE = ROOT / "code" / "attnbook"
NOTEBOOKS = ROOT / "notebooks"
REFERENCES = ROOT / "book" / "references.bib"
# Package data (the corpus snapshot), committed as it is: the one part of code/attnbook/ that no
# chapter generates.
DATA = PACKAGE / "data"
EXPORT_TAG = "export"  # and "export:<module>"
# Cell metadata that belongs to the notebook file, not to the chapter's content.
VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled")


@dataclass(frozen=True)
class Chapter:
    path: Path
    notebook: nbformat.NotebookNode

    @property
    def slug(self) -> str:
        return self.path.stem

    @property
    def relpath(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def title(self) -> str:
        for cell in self.notebook.cells:
            if cell.cell_type == "markdown":
                for line in cell.source.splitlines():
                    if line.startswith("# "):
                        return line[2:].strip()
        raise ValueError(f"{self.relpath} has no '# Title' heading")

    @property
    def module(self) -> str | None:
        return self.notebook.metadata.get("attnbook", {}).get("module")

    @property
    def descriptions(self) -> dict:
        """One line about each second module, from `attnbook: {describe: {name: line}}`."""
        return self.notebook.metadata.get("attnbook", {}).get("describe", {})

    @property
    def entry_points(self) -> dict:
        """`attnbook: {main: {module: function}}`: the function `python -m attnbook.<module>`
        calls. It is called under `if __name__ == "__main__"` at the end of the module, a line
        that no cell holds, since a notebook's kernel runs as `__main__` too."""
        return self.notebook.metadata.get("attnbook", {}).get("main", {})

    @property
    def continues(self) -> list[str]:
        """Modules an earlier chapter owns that this one adds to (the second half of a split)."""
        return list(self.notebook.metadata.get("attnbook", {}).get("continues", []))

    @property
    def wants_gpu(self) -> bool:
        """Whether the chapter has a GPU path worth a free Colab user's GPU quota."""
        return bool(self.notebook.metadata.get("attnbook", {}).get("gpu", False))

    @property
    def colab_install(self) -> list[str]:
        """What the chapter needs on Colab beyond the package and Colab's own packages."""
        return list(self.notebook.metadata.get("attnbook", {}).get("colab_install", []))

    def export_cells(self) -> list[ExportCell]:
        """The chapter's exported code cells, in order: the one reader of which cell feeds which
        module, shared by this tangler and tools/api_reference.py."""
        cells, section = [], None
        for index, cell in enumerate(self.notebook.cells):
            if cell.cell_type == "markdown":
                for title in HEADING.findall(FENCE.sub("", cell.source)):
                    section = title.strip()
                continue
            for tag in cell.metadata.get("tags", []) if cell.cell_type == "code" else []:
                if tag == EXPORT_TAG and not self.module:
                    raise ValueError(f"{self.relpath} exports cells but names no module")
                if tag == EXPORT_TAG or tag.startswith(EXPORT_TAG + ":"):
                    module = self.module if tag == EXPORT_TAG else tag.split(":", 1)[1]
                    cells.append(ExportCell(module, cell.source.strip(), index, section))
        return cells

    def exports(self) -> dict[str, list[ExportCell]]:
        """Exported cells by module name, in the chapter's order."""
        modules: dict[str, list[ExportCell]] = {}
        for cell in self.export_cells():
            modules.setdefault(cell.module, []).append(cell)
        return modules

    def description(self, module: str) -> str:
        """The module's one-line docstring: its line in the front matter's `describe`, else (for
        the chapter's own module) the chapter's title."""
        if module in self.descriptions:
            return self.descriptions[module]
        if module != self.module:
            raise ValueError(f"{self.relpath}: module {module!r} needs a line in `describe`")
        return f"{self.title}."


@dataclass(frozen=True)
class ExportCell:
    module: str
    source: str
    index: int  # the cell's position in the chapter
    section: str | None  # the nearest heading above the cell (None: none but the title)

    @property
    def continues(self) -> str | None:
        """The class whose body this cell continues (its first line `# continues Name`), or None."""
        found = CONTINUES.fullmatch(self.source.split("\n", 1)[0])
        return found.group(1) if found else None


CONTINUES = re.compile(r"# continues ([A-Za-z_]\w*)[ \t]*")  # a cell's first line
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
FENCE = re.compile(r"^(`{3,}|:{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)


def read_chapters() -> list[Chapter]:
    import jupytext  # here, so that tools/colab_check.py runs without the book's toolchain

    # Numbered chapters, then the appendices (a1-..., a2-...).
    paths = sorted(CHAPTERS.glob("[0-9][0-9]-*.md")) + sorted(CHAPTERS.glob("a[0-9]-*.md"))
    return [Chapter(path, jupytext.read(path, fmt="md:myst")) for path in paths]


def repository() -> tuple[str, str]:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def header(source: str) -> str:
    return f"# Do not edit: tools/tangle.py generates this file from {source}.\n"


def public_names(source: str) -> list[str]:
    """The names a cell (or a module) exports: its top-level functions, classes and UPPER_CASE
    constants that do not start with an underscore, and the names it re-exports from another
    attnbook module in the explicit form `from attnbook.m import name as name`."""
    defined = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.extend(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnbook."):
            defined.extend(alias.name for alias in node.names if alias.asname == alias.name)
    public = [name for name in defined if not name.startswith("_")]
    return list(dict.fromkeys(public))  # once each: @overload stubs repeat a function's name


def marker(chapter: Chapter, cell: ExportCell, source: str | None = None) -> str:
    """A generated cell (`source`, by default the cell's own) behind a comment saying where in the
    book to read about it and change it."""
    return f'# {chapter.relpath}, "{cell.section or chapter.title}"\n' + (source or cell.source)


# --- a class built over several cells ----------------------------------------------------------
# A cell whose first line is `# continues Name` adds methods to the class Name that an earlier
# exported cell of the same module defines. In the chapter (and its notebook) the cell defines
# each method as a function and attaches it, `Name.method = method`, so that it runs as written;
# in the module the functions go, indented, at the end of the class's body, behind a comment
# naming the cell's chapter and section, and the attaching lines are left out: the module reads
# as one class. Where a function would behave otherwise in a class body than attached after the
# class was made, the tangler refuses the cell rather than rewrite it (CONTRIBUTING.md, "Writing
# a chapter").

# Decorators that do the same to a function attached after its class was made as in its body
# (not e.g. functools.cached_property, which needs `__set_name__`, or abc.abstractmethod).
CONTINUED_DECORATORS = frozenset({"staticmethod", "classmethod", "property", "torch.no_grad()",
                                  "torch.inference_mode()"})
# Special methods that Python looks up on the class when used, so attaching them later is the
# same as defining them in the body (not e.g. __init_subclass__, implicitly a classmethod, or
# __eq__, which in a body also sets __hash__ to None).
CONTINUED_DUNDERS = frozenset({"__init__", "__repr__", "__str__", "__call__", "__len__",
                               "__iter__", "__getitem__", "__contains__", "__enter__", "__exit__"})


def _refuse(chapter: Chapter, cell: ExportCell, problem: str) -> ValueError:
    return ValueError(f"{chapter.relpath}, cell {cell.index} (# continues {cell.continues}): "
                      f"{problem}")


def _bindings(node: ast.AST) -> set[str]:
    """The names a statement binds in the scope it runs in (not in the functions, classes,
    lambdas and comprehensions it holds)."""
    names, stack = set(), [node]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            stack.extend(node.decorator_list)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name != "*")
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
            stack.extend(ast.iter_child_nodes(node))
        elif not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                   ast.GeneratorExp)):
            stack.extend(ast.iter_child_nodes(node))
    return names


def _functions_and_attaching_lines(chapter: Chapter, cell: ExportCell, tree: ast.Module):
    """A continuing cell's functions by name, and the statements that attach them."""
    name = cell.continues
    functions, attaching = {}, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in functions:
                raise _refuse(chapter, cell, f"{node.name} is defined twice")
            functions[node.name] = node
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(target := node.targets[0], ast.Attribute)
              and isinstance(target.value, ast.Name) and isinstance(node.value, ast.Name)
              and target.value.id == name and target.attr == node.value.id):
            if target.attr not in functions:
                raise _refuse(chapter, cell, f"line {node.lineno} attaches {target.attr} before "
                              "the cell defines it: attach each function after its def")
            attaching.append(node)
        else:
            raise _refuse(chapter, cell, f"line {node.lineno} is neither a method (def) nor "
                          f"its attaching line, `{name}.<method> = <method>`")
    attached = sorted(node.targets[0].attr for node in attaching)
    if attached != sorted(functions):
        raise _refuse(chapter, cell, f"each function must be attached once, `{name}.f = f`: "
                      f"defined {sorted(functions)}, attached {attached}")
    return functions, attaching


def _check_function(chapter: Chapter, cell: ExportCell, function: ast.FunctionDef) -> None:
    """Refuse a function that would behave otherwise in the class body than attached."""
    name = cell.continues
    if function.name.startswith("__") and function.name not in CONTINUED_DUNDERS:
        raise _refuse(chapter, cell, f"{function.name}: of the names starting with '__', only "
                      f"{', '.join(sorted(CONTINUED_DUNDERS))} may be defined in a continuing cell")
    for decorator in function.decorator_list:
        if ast.unparse(decorator) not in CONTINUED_DECORATORS:
            raise _refuse(chapter, cell, f"{function.name} is decorated with "
                          f"@{ast.unparse(decorator)}; a continuing cell allows only "
                          f"{', '.join('@' + d for d in sorted(CONTINUED_DECORATORS))}")
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "super" and not node.args):
            raise _refuse(chapter, cell, f"{function.name} calls super() without arguments, "
                          f"which fails outside a class body: write super({name}, self)")
        if isinstance(node, ast.Name) and node.id == "__class__":
            raise _refuse(chapter, cell, f"{function.name} uses __class__, which only a class "
                          "body defines")


def _refuse_private_names(chapter: Chapter, cell: ExportCell) -> None:
    """A name `__x` in a class body becomes `_Class__x` (name mangling), outside it stays."""
    for token in tokenize.generate_tokens(io.StringIO(cell.source).readline):
        if (token.type == tokenize.NAME and token.string.startswith("__")
                and not token.string.endswith("__")):
            raise _refuse(chapter, cell, f"line {token.start[0]} uses {token.string}, which "
                          f"Python renames to _{cell.continues.lstrip('_')}{token.string} in a "
                          "class body only: use one leading underscore")


def _docstring_tokens(tree: ast.Module, source: str) -> set[tuple[int, int]]:
    """Where the docstrings of a cell start, (line, column in characters) as tokenize counts."""
    lines = source.splitlines()
    starts = set()
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and ast.get_docstring(node, clean=False) is not None):
            string = node.body[0].value
            line = lines[string.lineno - 1].encode()
            starts.add((string.lineno, len(line[:string.col_offset].decode())))
    return starts


def _method_lines(chapter: Chapter, cell: ExportCell) -> list[str]:
    """The lines of a continuing cell's functions, with the comments and single blank lines
    between them, at the indentation of a class body; without the marker and the attaching lines.
    A docstring's inner lines are indented with the rest and its blank lines kept, so that the
    method's docstring reads as the chapter's (inspect.getdoc gives the same text)."""
    source = cell.source
    tree = ast.parse(source)
    functions, attaching = _functions_and_attaching_lines(chapter, cell, tree)
    dropped = {0}  # the marker is line 0
    for node in attaching:
        dropped.update(range(node.lineno - 1, node.end_lineno))
    for function in functions.values():
        _check_function(chapter, cell, function)
    _refuse_private_names(chapter, cell)
    verbatim = _refuse_multiline_strings(chapter, cell, tree)
    kept = []
    for i, line in enumerate(source.splitlines()):
        if i in dropped:
            continue
        if i in verbatim:  # inside a docstring: every line kept, blank ones too
            kept.append(f"    {line}" if line.strip() else line)
        elif line.strip() or (kept and kept[-1].strip()):  # a run of blank lines becomes one
            kept.append(f"    {line}" if line.strip() else "")
    while kept and not kept[-1]:
        kept.pop()
    return kept


def _refuse_multiline_strings(chapter: Chapter, cell: ExportCell, tree: ast.Module) -> set[int]:
    """Indenting a function changes a string literal that spans lines, unless it is a docstring,
    whose inner lines are then kept as written: any other such string is refused, not silently
    changed. Returns the (0-based) lines inside the docstrings, whose blank lines are kept."""
    docstrings = _docstring_tokens(tree, cell.source)
    verbatim = set()
    opened = []  # from Python 3.12 an f-string is several tokens: where the open ones started
    for token in tokenize.generate_tokens(io.StringIO(cell.source).readline):
        kind = tokenize.tok_name[token.type]
        if kind == "FSTRING_START":
            opened.append(token.start)
        start = opened.pop() if kind == "FSTRING_END" else token.start
        if kind not in ("STRING", "FSTRING_END") or start[0] == token.end[0]:
            continue
        if start not in docstrings or kind != "STRING":
            raise _refuse(chapter, cell, f"line {start[0]} starts a string over several lines, "
                          "which indenting into the class would change: build it from one-line "
                          "strings, or define it outside the class")
        verbatim.update(range(start[0], token.end[0]))  # 0-based: the lines after the first
    return verbatim


def _insert_methods(source: str, name: str, methods: list[str]) -> str:
    """`source` with `methods` (lines, indented) added at the end of its top-level class `name`."""
    classes = [node for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and node.name == name]
    lines = source.splitlines()
    end = classes[-1].end_lineno  # the class's last line
    return "\n".join(lines[:end] + [""] + methods + lines[end:])


@dataclass
class _Continued:
    """A class that continuing cells may add methods to, while its name still means it."""
    merged: int  # the index of the merged cell that defines it
    node: ast.ClassDef
    where: str  # its chapter and cell
    body: set[str]  # the names its body binds
    later: set[str]  # the names module-level code binds after it
    used: str | None = None  # where module-level code first uses it after it is made


def _import_time_names(node: ast.AST) -> set[str]:
    """The names a statement reads when it runs (not in the bodies of its functions)."""
    names, stack = set(), [node]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            stack.extend([*getattr(node, "decorator_list", []), *args.defaults,
                          *(d for d in args.kw_defaults if d is not None)])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names.add(node.id)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return names


def _check_continued_class(chapter: Chapter, cell: ExportCell, state: _Continued,
                           abstract: set[str]) -> None:
    node, name = state.node, cell.continues
    if state.used:
        raise _refuse(chapter, cell, f"{state.used} uses {name} when it runs, before this cell "
                      "adds its methods (in the module they are there already): add them first")
    if node.body[0].lineno == node.lineno:
        raise _refuse(chapter, cell, f"class {name} ({state.where}) has its body on the line of "
                      "`class`: write the body on lines of its own")
    tree = ast.parse(cell.source)
    functions, _ = _functions_and_attaching_lines(chapter, cell, tree)
    # @dataclass reads the fields and the methods whose names start with "__" (__post_init__,
    # __eq__, ...) when it makes the class; a dataclass may take any other method later
    dataclass_only = all(re.fullmatch(r"(dataclasses\.)?dataclass(\(.*\))?", ast.unparse(d))
                         for d in node.decorator_list)
    if (node.decorator_list and not (dataclass_only and not any(
            f.startswith("__") for f in functions))) or node.keywords or any(
            ast.unparse(base) in ("ABC", "abc.ABC") for base in node.bases):
        raise _refuse(chapter, cell, f"class {name} ({state.where}) is decorated, has a "
                      "metaclass or is an ABC, which reads the body when the class is made: "
                      "define its methods in the class's cell")
    for function in functions.values():
        if function.name in abstract:
            raise _refuse(chapter, cell, f"{function.name} is an abstract method of the module, "
                          "which only a class body implements: define it in the class's cell")
        args = function.args
        evaluated = [*function.decorator_list, *args.defaults,
                     *(d for d in args.kw_defaults if d is not None), function.returns,
                     *(a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                              args.vararg, args.kwarg) if a is not None)]
        used = {n.id for e in evaluated if e is not None for n in ast.walk(e)
                if isinstance(n, ast.Name)}
        if name in used:  # the class's name is bound only once its body has run
            raise _refuse(chapter, cell, f"{function.name}'s decorators, defaults or annotations "
                          f"name {name}, which its class body cannot: quote an annotation "
                          f"(\"{name}\")")
        for found in sorted(used & (state.later | state.body)):
            where = "the class's body" if found in state.body else "a cell after the class"
            raise _refuse(chapter, cell, f"{function.name}'s decorators, defaults or annotations "
                          f"name {found}, which {where} binds: in the class body it would mean "
                          "something else")


def _continuing_names(cells: list[tuple[Chapter, ExportCell]]) -> None:
    """A continuing cell's functions are globals of the chapter but not of the module: refuse
    one whose name the module binds or uses (the chapter would overwrite or call it)."""
    defined, uses, bound = {}, set(), set()
    for chapter, cell in cells:
        tree = ast.parse(cell.source)
        if cell.continues is None:
            bound.update(*(_bindings(node) for node in tree.body))
            nodes = [tree]
        else:
            nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            defined.update({n.name: (chapter, cell) for n in nodes})
        uses.update(n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name))
    for name, (chapter, cell) in defined.items():
        if name in bound or name in uses:
            how = "a module-level name" if name in bound else "used by its bare name"
            raise _refuse(chapter, cell, f"{name} is also {how} in module {cell.module!r}; in "
                          "the chapter the cell makes it a global, in the module a method only: "
                          f"rename it, or call it as self.{name}")


def module_cells(cells: list[tuple[Chapter, ExportCell]]) -> list[tuple[Chapter, ExportCell, str]]:
    """A module's cells, each with the source it contributes: a cell that continues a class
    (`# continues Name`) contributes nothing of its own, its methods go into the class's cell."""
    merged: list[tuple[Chapter, ExportCell, str]] = []
    classes: dict[str, _Continued] = {}  # a class name -> where it is defined, while it is
    shadowed: dict[str, str] = {}  # a class name -> what rebound it
    _continuing_names(cells)
    abstract = {node.name for _, cell in cells for node in ast.walk(ast.parse(cell.source))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and any("abstract" in ast.unparse(d) for d in node.decorator_list)}
    for chapter, cell in cells:
        name = cell.continues
        if name is None:
            merged.append((chapter, cell, cell.source))
            for node in ast.parse(cell.source).body:
                bound, read = _bindings(node), _import_time_names(node)
                for class_name, state in classes.items():
                    state.later |= bound
                    if class_name in read and state.used is None:
                        state.used = f"{chapter.relpath}, cell {cell.index}, line {node.lineno}"
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = _Continued(
                        len(merged) - 1, node, f"{chapter.relpath}, cell {cell.index}",
                        set().union(*(_bindings(n) for n in node.body)), set())
                    shadowed.pop(node.name, None)
                for other in bound & set(classes) - {getattr(node, "name", None)
                                                     if isinstance(node, ast.ClassDef) else None}:
                    del classes[other]
                    shadowed[other] = f"{chapter.relpath}, cell {cell.index}, line {node.lineno}"
            continue
        if name in shadowed:
            raise _refuse(chapter, cell, f"{name} is rebound after its class ({shadowed[name]}), "
                          "so the chapter adds the methods to something else: the class must be "
                          "the last thing the name is bound to before this cell")
        if name not in classes:
            raise _refuse(chapter, cell, f"no earlier exported cell of module {cell.module!r} "
                          f"defines a class {name}")
        state = classes[name]
        _check_continued_class(chapter, cell, state, abstract)
        methods = _method_lines(chapter, cell)
        owner, owner_cell, source = merged[state.merged]
        comment = f"    {marker(chapter, cell).splitlines()[0]}"
        merged[state.merged] = (owner, owner_cell, _insert_methods(
            source, name, [comment] + methods))
        state.body.update(n.name for n in ast.parse(cell.source).body
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return merged


def module_source(parts: list[tuple[Chapter, list[ExportCell]]], module: str) -> str:
    """One module: its header, a one-line docstring, `__all__`, then each cell behind a marker
    naming its chapter and section. `parts` is each chapter that writes the module with its cells,
    in the book's order: the first owns it, and a later one continues it (a chapter split in two)."""
    owner = parts[0][0]
    sources = " and ".join(chapter.relpath for chapter, _ in parts)
    docstring = (
        f'"""{textwrap.fill(owner.description(module), 96)}\n\n'
        f"Built and explained in the book's chapter{'s' if len(parts) > 1 else ''} {sources}.\n"
        '"""\n'
    )
    cells = module_cells([(chapter, cell) for chapter, chapter_cells in parts
                          for cell in chapter_cells])
    names = public_names("\n\n".join(source for _, _, source in cells))
    exports = "__all__ = [\n" + "".join(f'    "{name}",\n' for name in names) + "]\n"
    body = "\n\n\n".join(marker(chapter, cell, source) for chapter, cell, source in cells)
    if function := owner.entry_points.get(module):
        body += (f'\n\n\nif __name__ == "__main__":  # python -m attnbook.{module}\n'
                 f"    {function}()")
    return f"{header(sources)}{docstring}\n{exports}\n{body}\n"


def init_source(chapters: list[Chapter]) -> str:
    modules = list(owners(chapters).items())
    listing = "".join(textwrap.fill(f"- attnbook.{m} ({c.relpath}): {c.description(m)}", 96,
                                    subsequent_indent="  ", break_on_hyphens=False) + "\n"
                      for m, c in modules)
    names = "".join(f'    "{m}",\n' for m, _ in modules)
    return (
        f"{header('the chapters in chapters/')}"
        '"""attnbook: Transformer attention built from scratch, one chapter at a time.\n\n'
        f"Modules, in the order the book builds them:\n\n{listing}"
        '"""\n\n'
        "import importlib\nfrom types import ModuleType\n\n"
        f'__version__ = "{version()}"\n'
        f"__all__ = [\n{names}]\n\n\n"
        "def __getattr__(name: str) -> ModuleType:\n"
        "    # Modules load on first use, so `import attnbook` stays cheap and a module with an\n"
        "    # optional dependency (triton, transformers) costs nothing until it is used.\n"
        "    if name in __all__:\n"
        '        return importlib.import_module(f".{name}", __name__)\n'
        '    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")\n'
    )


def owners(chapters: list[Chapter]) -> dict[str, Chapter]:
    """Each module's owner: the first chapter that writes it, in the book's order."""
    found: dict[str, Chapter] = {}
    for chapter in chapters:
        for module in chapter.exports():
            found.setdefault(module, chapter)
    return found


def package_files(chapters: list[Chapter]) -> dict[str, str]:
    """Every file of code/attnbook/, by path relative to the repository root. A chapter may
    continue a module an earlier chapter owns only when its front matter says so
    (`attnbook: {continues: [module]}`), so that no module is written by two chapters unawares."""
    parts: dict[str, list[tuple[Chapter, list[ExportCell]]]] = {}
    for chapter in chapters:
        for module, cells in chapter.exports().items():
            if module in parts and module not in chapter.continues:
                raise ValueError(f"module {module!r} is claimed by two chapters "
                                 f"({parts[module][0][0].relpath} and {chapter.relpath}); the "
                                 f"second may continue it with `attnbook: {{continues: [{module}]}}`")
            parts.setdefault(module, []).append((chapter, cells))
    files = {(PACKAGE / f"{m}.py").relative_to(ROOT).as_posix(): module_source(p, m)
             for m, p in parts.items()}
    files[(PACKAGE / "__init__.py").relative_to(ROOT).as_posix()] = init_source(chapters)
    return files


# The line of the setup cell that names what it installs: a branch in the committed notebooks, a
# commit in the copies the site publishes (pin).
REF_LINE = re.compile(r'^REF = "([^"]*)"$', re.MULTILINE)


def installed_ref(nb: nbformat.NotebookNode) -> str | None:
    """The branch or commit of the repository that a notebook's setup cell installs on Colab."""
    found = REF_LINE.search(nb.cells[0].source) if nb.cells else None
    return found.group(1) if found else None


def pin(nb: nbformat.NotebookNode, commit: str) -> nbformat.NotebookNode:
    """`nb` installing the package of `commit` instead of its branch; nothing else changes, its
    outputs included (the deploy pins the site's copies; tools/colab_check.py pins this clone's)."""
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        raise ValueError(f"commit must be a hexadecimal commit id, got commit={commit!r}")
    if installed_ref(nb) is None:
        raise ValueError("the notebook's first cell is not the tangler's setup cell")
    nb.cells[0].source = REF_LINE.sub(f'REF = "{commit}"', nb.cells[0].source, count=1)
    return nb


def setup_cell_source(chapter: Chapter) -> str:
    url, branch = repository()
    extra = "".join(f", {requirement!r}" for requirement in chapter.colab_install)
    return (
        "# Setup. On Google Colab this installs the book's package from its repository at REF (the\n"
        "# branch this notebook is on; the site's copy names the commit it was published from),\n"
        "# and nothing that Colab already has; anywhere else it only reports the package and the\n"
        "# hardware the notebook runs on.\n"
        "import subprocess\n"
        "import sys\n"
        "from importlib.metadata import version\n"
        "\n"
        "import torch\n"
        "\n"
        f'REF = "{branch}"\n'
        "\n"
        'if "google.colab" in sys.modules:\n'
        f'    packages = [f"attnbook @ git+{url}@{{REF}}"{extra}]\n'
        '    pip = subprocess.run([sys.executable, "-m", "pip", "install", *packages],\n'
        "                         capture_output=True, text=True)\n"
        "    if pip.returncode != 0:\n"
        "        print(pip.stdout[-4000:], pip.stderr[-4000:], sep=\"\\n\")\n"
        '        raise RuntimeError("pip could not install the book\'s package: its output is above")\n'
        '    done = [line for line in pip.stdout.splitlines() if line.startswith("Successfully")]\n'
        '    installed = done[-1] if done else "nothing new installed"\n'
        "else:\n"
        '    installed = "not on Colab, nothing installed"\n'
        "\n"
        'gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU only)"\n'
        'print(f"attnbook {version(\'attnbook\')} ({installed}); GPU: {gpu}")'
    )


TERM = re.compile(r"\{term\}`([^`]*?)(?:\s*<[^`]*>)?`")  # {term}`text <entry>` or {term}`entry`
CITE = re.compile(r"\{cite(?::p)?\}`([^`]*)`")  # {cite}`key` and {cite:p}`key, key`
GLUE = re.compile(r"\{glue:text\}`([^`]*)`")
GLUE_RECORD = "application/papermill.record/text/plain"  # myst-nb's glue output
# attnbook.notebook.glue(name, value, digits=2) also records name + DIGITS_SUFFIX = 2. The same
# constant is attnbook.notebook.DIGITS_SUFFIX: the tools keep this copy so that they run without
# the package (tests/test_pipeline.py checks that the two agree).
DIGITS_SUFFIX = "__digits"
ADMONITION = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{admonition\}[ \t]*(?P<title>[^\n]*)\n"
    r"(?P<options>(?::[\w-]+:[^\n]*\n)*)"
    r"(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


@functools.cache  # one parse per run, not one per chapter (a fifth of a run's time)
def citations() -> dict[str, str]:
    """'Author et al., year' for each entry of the book's BibTeX file, by key."""
    from pybtex.database import parse_file  # the parser sphinxcontrib-bibtex uses for the site

    found = {}
    for key, entry in parse_file(REFERENCES, bib_format="bibtex").entries.items():
        surnames = [" ".join(p.last_names).strip("{}") for p in entry.persons["author"]]
        who = surnames[0] if len(surnames) == 1 else (
            " and ".join(surnames) if len(surnames) == 2 else f"{surnames[0]} et al.")
        found[key] = f"{who}, {entry.fields['year']}"
    return found


def plain_markdown(text: str, cited: dict[str, str]) -> str:
    """A text cell of a chapter with MyST's roles and directives as plain Markdown. Glue roles
    stay: their values come from the executed notebook (fill_glue)."""

    def cite(match):
        keys = [k.strip() for k in match.group(1).split(",")]
        missing = [k for k in keys if k not in cited]
        if missing:
            raise ValueError(f"{missing} cited but not in {REFERENCES.relative_to(ROOT)}")
        return "(" + "; ".join(cited[k] for k in keys) + ")"

    def admonition(match):
        title, body = match.group("title").strip(), match.group("body").strip("\n")
        if "dropdown" in match.group("options"):
            return f"<details>\n<summary>{title}</summary>\n\n{body}\n\n</details>"
        return f"**{title}**\n\n{body}"

    text = ADMONITION.sub(admonition, text)
    text = TERM.sub(lambda m: m.group(1), text)
    return CITE.sub(cite, text)


def glued_values(nb: nbformat.NotebookNode) -> dict[str, str]:
    """Each name an executed notebook glued, with the text of its record: the one reader of glued
    values, shared by fill_glue, tools/glue_digits_check.py and tools/gpu_chapters_on_cpu.py."""
    values = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name and GLUE_RECORD in output.get("data", {}):
                values[name] = output["data"][GLUE_RECORD]
    return values


def fill_glue(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Replace each {glue:text}`name:format` of the text cells by the value the notebook's
    outputs hold for `name`, formatted as myst-nb formats it on the site."""
    from myst_nb.core.variables import format_plain_text

    values = glued_values(nb)

    def paste(match):
        name, _, spec = match.group(1).partition(":")
        if name not in values:
            return match.group(0)  # not executed yet
        return format_plain_text(values[name], spec or "s")

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = GLUE.sub(paste, cell.source)
    return nb


HIDDEN_TAG = "hide-input"  # the site shows such a cell's code collapsed: solutions, drawing code


HIDDEN_TITLE_END = "(double-click to show the code)"
# Cell metadata that changes how a cell is shown, never what it computes: hide_source's, and
# myst-nb's (a figure's number, caption and alt text).
SHOWING = ("jupyter", "cellView", "mystnb")


def chapter_source(notebook_cell: nbformat.NotebookNode) -> str:
    """A notebook code cell's source as its chapter writes it: without hide_source's title."""
    first, _, rest = notebook_cell.source.partition("\n")
    hidden = first.startswith("# @title ") and first.endswith(HIDDEN_TITLE_END)
    return rest if hidden else notebook_cell.source


def hide_source(cell: nbformat.NotebookNode, section: str | None) -> None:
    """Hide a code cell's source where the notebook is read, as the site hides it: Jupyter reads
    `jupyter.source_hidden`, and Colab shows a cell with `cellView: form` as its `# @title`
    line alone, its code one double-click away. The title says what is hidden."""
    what = "Solutions" if section == "Exercises" else "Hidden code"
    cell.source = f"# @title {what} {HIDDEN_TITLE_END}\n" + cell.source
    cell.metadata["jupyter"] = {"source_hidden": True}
    cell.metadata["cellView"] = "form"


def notebook_source(chapter: Chapter) -> nbformat.NotebookNode:
    """The chapter as a Jupyter notebook, without outputs (and so with glue roles unfilled),
    whose setup cell installs the package on Colab."""
    setup = nbformat.v4.new_code_cell(setup_cell_source(chapter))
    setup.metadata["tags"] = ["nbval-ignore-output"]
    cells = [setup]
    cited = citations()
    section = None
    for cell in chapter.notebook.cells:
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            if HIDDEN_TAG in cell.metadata.get("tags", []):
                hide_source(cell, section)
        elif cell.cell_type == "markdown":
            for title in HEADING.findall(FENCE.sub("", cell.source)):
                section = title.strip()
            cell.source = plain_markdown(cell.source, cited)
        cells.append(cell)
    for index, cell in enumerate(cells):
        cell.id = f"cell-{index:03d}"
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    if chapter.wants_gpu:  # Colab opens it on a GPU runtime, when one is free
        nb.metadata["accelerator"] = "GPU"
        nb.metadata["colab"]["gpuType"] = "T4"
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


# The modules of the package a chapter's notebook runs, found in its code cells and, in turn, in
# those modules: `attnbook.heads` (in `import attnbook.heads`, `from attnbook.heads import ...`
# or `attnbook.heads.attend(...)`) and `from attnbook import heads, masks as m`.
IMPORTED = re.compile(r"\battnbook\.(\w+)|^[ \t]*from attnbook import ([\w ,]+)", re.MULTILINE)
# Notebook metadata that its execution writes: `{"package": digest}`, a digest of the modules of
# the package it ran (package_digest). Like the outputs, kept while its code is unchanged.
RUN_METADATA = "attnbook"


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The modules among `modules` that Python source (a cell, a module) imports or uses."""
    found = set()
    for dotted, names in IMPORTED.findall(source):
        found.update([dotted] if dotted else [n.split(" as ")[0].strip() for n in names.split(",")])
    return found & modules


def package_uses(chapter: Chapter, files: dict[str, str]) -> set[str]:
    """The modules a chapter's notebook runs: those its code cells name (its own among them) and
    every module that those import, in turn. `files` is package_files' output."""
    sources = {Path(rel).stem: text for rel, text in files.items() if not rel.endswith("__init__.py")}
    code = "\n".join(cell.source for cell in chapter.notebook.cells if cell.cell_type == "code")
    todo, used = imported_modules(code, set(sources)) | set(chapter.exports()), set()
    while todo:
        module = todo.pop()
        used.add(module)
        todo |= imported_modules(sources[module], set(sources)) - used
    return used


def package_digest(chapter: Chapter, files: dict[str, str]) -> str:
    """A digest of the modules a chapter's notebook runs, as the chapters now write them: when it
    differs from the one the notebook recorded, the notebook ran another package."""
    digest = hashlib.sha256()
    for module in sorted(package_uses(chapter, files)):
        digest.update(f"{module}\n{files[f'code/attnbook/{module}.py']}\n".encode())
    return digest.hexdigest()[:16]


def recorded_digest(nb: nbformat.NotebookNode | None) -> str | None:
    return None if nb is None else nb.metadata.get(RUN_METADATA, {}).get("package")


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What of a notebook the chapter determines: cells and their sources, not outputs (nor what
    the run recorded of the package)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop(RUN_METADATA, None)
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("language_info", None)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def dumps(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def same_code(a: nbformat.NotebookNode, b: nbformat.NotebookNode) -> bool:
    """Whether two notebooks run the same code. The setup cell is left out: on Colab it installs
    the package, and anywhere else its outputs depend on nothing that it pins. So is how a cell
    is shown (hide_source's title comment, SHOWING's metadata), which changes nothing it computes."""

    def code(nb):
        cells = strip_outputs(nb).cells[1:]
        return [(chapter_source(c), {k: v for k, v in c.metadata.items() if k not in SHOWING})
                for c in cells if c.cell_type == "code"]

    return code(a) == code(b)


def with_outputs_of(executed: nbformat.NotebookNode, fresh: nbformat.NotebookNode):
    """`fresh` with the outputs of `executed`, a notebook with the same code cells, and its record
    of the package it ran."""
    if RUN_METADATA in executed.metadata:
        fresh.metadata[RUN_METADATA] = copy.deepcopy(executed.metadata[RUN_METADATA])
    done = iter([c for c in executed.cells if c.cell_type == "code"])
    for cell in fresh.cells:
        if cell.cell_type == "code":
            old = next(done)
            cell.outputs, cell.execution_count = old.outputs, old.execution_count
    return fresh


def expected_notebook(chapter: Chapter, old: nbformat.NotebookNode | None):
    """What the chapter makes of its notebook: with `old`'s outputs (and glued values) where `old`
    ran the same code (its setup cell may differ: see same_code), otherwise without outputs."""
    fresh = notebook_source(chapter)
    if old is not None and same_code(old, fresh) and not never_executed(old):
        return fill_glue(with_outputs_of(old, fresh))
    return fresh


def never_executed(nb: nbformat.NotebookNode) -> bool:
    return any(cell.cell_type == "code" and cell.execution_count is None for cell in nb.cells)


def notebook_path(chapter: Chapter) -> Path:
    return NOTEBOOKS / f"{chapter.slug}.ipynb"


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    return nb


def write(execute_changed: bool, force: bool, only: list[str]) -> None:
    chapters = read_chapters()
    expected = package_files(chapters)
    for stale in set(existing_package_files()) - set(expected):
        (ROOT / stale).unlink()
    for rel, text in expected.items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {rel}")

    NOTEBOOKS.mkdir(exist_ok=True)
    wanted = {notebook_path(c) for c in chapters}
    for stale in set(NOTEBOOKS.glob("*.ipynb")) - wanted:
        stale.unlink()
        print(f"removed {stale.relative_to(ROOT)}")
    for chapter in chapters:
        if only and not any(chapter.slug.startswith(prefix) for prefix in only):
            continue
        path = notebook_path(chapter)
        old = nbformat.read(path, as_version=4) if path.exists() else None
        fresh = expected_notebook(chapter, old)
        digest = package_digest(chapter, expected)
        # Outputs are kept while the notebook's code is the chapter's (its prose may differ) ...
        kept = old is not None and same_code(old, fresh) and not never_executed(old)
        # ... but they may come from another version of the modules it runs (another chapter's).
        other_package = kept and recorded_digest(old) != digest
        if force or (execute_changed and (not kept or other_package)):
            why = " (a module it runs changed)" if kept and not force else ""
            print(f"executing {chapter.relpath}{why} ...", flush=True)
            fresh = fill_glue(execute(notebook_source(chapter)))
            fresh.metadata[RUN_METADATA] = {"package": digest}
        elif old is not None and dumps(strip_outputs(old)) == dumps(strip_outputs(fresh)):
            if other_package:
                print(f"{path.relative_to(ROOT)}: ran another version of a module it runs "
                      "(make notebooks)")
            continue
        elif old is not None and not kept:
            print(f"{path.relative_to(ROOT)}: source changed, outputs dropped (make notebooks)")
        path.write_text(dumps(fresh))
        print(f"wrote {path.relative_to(ROOT)}")


def existing_package_files() -> list[str]:
    return [
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and DATA not in p.parents
    ]


def check() -> int:
    """Compare code/ and notebooks/ with what the chapters produce; print each difference."""
    problems: list[str] = []
    chapters = read_chapters()
    expected = package_files(chapters)
    actual = set(existing_package_files())
    for rel in sorted(actual - set(expected)):
        problems.append(f"{rel}: not produced by any chapter (remove it, or run make tangle)")
    for rel, text in sorted(expected.items()):
        path = ROOT / rel
        if not path.exists():
            problems.append(f"{rel}: missing (run make tangle)")
        elif path.read_text() != text:
            diff = difflib.unified_diff(
                path.read_text().splitlines(), text.splitlines(), rel, "tangled", lineterm=""
            )
            problems.append(f"{rel}: differs from its chapter (run make tangle)\n" + "\n".join(diff))

    wanted = {notebook_path(c): c for c in chapters}
    for path in sorted(set(NOTEBOOKS.glob("*.ipynb")) - set(wanted)):
        problems.append(f"{path.relative_to(ROOT)}: no chapter produces it")
    for path, chapter in sorted(wanted.items()):
        rel = path.relative_to(ROOT)
        if not path.exists():
            problems.append(f"{rel}: missing (run make notebooks)")
            continue
        committed = nbformat.read(path, as_version=4)
        expected = strip_outputs(expected_notebook(chapter, committed))
        if dumps(strip_outputs(committed)) != dumps(expected):
            problems.append(f"{rel}: out of date with {chapter.relpath} (run make notebooks)")
        elif never_executed(committed):
            problems.append(f"{rel}: has cells that were never executed (run make notebooks)")
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"tangle check: code/ and notebooks/ match the {len(chapters)} chapters")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--execute", action="store_true", help="run notebooks whose source changed")
    parser.add_argument("--force", action="store_true", help="run every (selected) notebook")
    parser.add_argument("--pin", metavar="SHA", help="make the notebooks named install commit SHA")
    parser.add_argument("only", nargs="*", help="chapter prefixes to (re)execute, e.g. 01; with "
                        "--pin, the notebook files to pin")
    args = parser.parse_args()
    if args.check:
        return check()
    if args.pin:
        if not args.only:
            parser.error("--pin needs the notebook files to pin")
        for name in args.only:
            path = Path(name)
            path.write_text(dumps(pin(nbformat.read(path, as_version=4), args.pin)))
        print(f"tangle: {len(args.only)} notebooks install the package of {args.pin}")
        return 0
    write(execute_changed=args.execute, force=args.force, only=args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
