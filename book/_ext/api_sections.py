"""Sphinx extension: the API reference's link from each name to the chapter section building it.

book/api.md (written by tools/api_reference.py) documents every public name of attnbook with
autodoc, and ends each entry with

    .. built-in:: chapters/01-queries-keys-values#scaled-dot-product-attention

which becomes "Built in <the chapter>, <the section>.", each a link to that page and to that
heading's MyST anchor (myst_heading_anchors), resolved by myst-parser as a Markdown link
`[](chapters/01-queries-keys-values.md#...)` is: an anchor that does not exist is a warning, an
error under -W. A chapter that is not on the site (not in _toc.yml) is named without a link.

A constant (autodoc's `data`) that has no doc-comment of its own is shown without the docstring
of its type (`dict`'s, `bool`'s), which autodoc would otherwise show as the constant's.

sphinx-codeautolink links the names in the chapters' code cells to those entries, and to nothing
else: with no intersphinx (the build is offline) the API page is its whole inventory. Before it
resolves them, every name that does not start at attnbook is dropped (`only_package_names`):
resolving one imports and follows its package, with that package's TYPE_CHECKING imports (all
of transformers' models: 21 to 24 s of CPU of the HTML build's 143 s), and then finds no
entry for it.

The package is imported by autodoc while the book is built; on a machine without a GPU, Triton's
kernels (attnbook.kernels) need its interpreter, which must be chosen before triton is imported.
"""

from __future__ import annotations

import inspect

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.util.docutils import SphinxDirective


def use_triton_interpreter() -> None:
    """The package's own choice of Triton's mode (attnbook.triton_mode, chapter 15): the
    interpreter where there is no GPU, before autodoc imports attnbook.kernels; tools/
    api_reference.py calls it too."""
    from attnbook.triton_mode import use_triton_interpreter as choose

    choose()


class BuiltIn(SphinxDirective):
    """`.. built-in:: chapters/NN-slug[#anchor]`: where the entry's name is built."""

    required_arguments = 1

    def link(self, doc: str, anchor: str | None) -> pending_xref:
        """A link myst-parser resolves, showing the chapter's or the section's title."""
        return pending_xref(
            "", nodes.inline("", ""), refdomain="doc", reftype="myst", reftarget=doc,
            reftargetid=anchor, refexplicit=False, refdoc=self.env.docname, refwarn=True,
        )

    def run(self) -> list[nodes.Node]:
        doc, _, anchor = self.arguments[0].partition("#")
        paragraph = nodes.paragraph(classes=["api-built-in"])
        paragraph += nodes.Text("Built in ")
        if doc not in self.env.found_docs:
            paragraph += nodes.literal(text=f"{doc}.md")
            paragraph += nodes.Text(" (not yet on this site).")
            return [paragraph]
        paragraph += self.link(doc, None)
        if anchor:
            paragraph += nodes.Text(", section ")
            paragraph += self.link(doc, anchor)
        paragraph += nodes.Text(".")
        return [paragraph]


def drop_type_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    """autodoc-process-docstring: a constant's docstring is its own or none."""
    type_doc = getattr(type(obj), "__doc__", None)
    if what == "data" and type_doc and "\n".join(lines).strip() == inspect.cleandoc(type_doc):
        lines.clear()


def only_package_names(app, env) -> None:
    """env-updated, before sphinx-codeautolink's own handler (priority 500) resolves the names
    of the code cells: only a name that starts at attnbook can reach an entry of the API page."""
    for transforms in getattr(env, "sphinx_codeautolink_transforms", {}).values():
        for transform in transforms:
            transform.names = [name for name in transform.names
                               if name.import_components[:1] == ["attnbook"]]


def setup(app):
    use_triton_interpreter()
    app.connect("env-updated", only_package_names, priority=400)
    app.add_directive("built-in", BuiltIn)
    app.connect("autodoc-process-docstring", drop_type_docstring)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
