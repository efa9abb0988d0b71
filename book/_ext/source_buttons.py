"""Sphinx extension: the repository menu's buttons read "Edit this page" and "Open an issue", and
a page that a tool writes at build time (book/api.md, from tools/api_reference.py) has no edit
button: the file it would open is not in the repository.

tools/site_check.py (make site-check) checks both on the built pages.
"""

from __future__ import annotations

GENERATED_PAGES = {"book/api"}  # written by tools/api_reference.py, not committed


def relabel_source_buttons(app, pagename, templatename, context, doctree) -> None:
    """After sphinx-book-theme's add_source_buttons (priority 501) has made the menu."""
    names = {"source-edit-button": "Edit this page", "source-issues-button": "Open an issue"}
    for group in context.get("header_buttons", []):
        if group.get("label") != "source-buttons":
            continue
        group["buttons"] = [
            {**button, "text": names.get(button.get("label"), button.get("text"))}
            for button in group["buttons"]
            if not (button.get("label") == "source-edit-button" and pagename in GENERATED_PAGES)
        ]


def setup(app):
    app.connect("html-page-context", relabel_source_buttons, priority=600)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
