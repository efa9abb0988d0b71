"""Sphinx extension: an "Open in Colab" link at the top of every chapter page.

The link opens the chapter's generated notebook, notebooks/<chapter>.ipynb, in the repository
and branch named once in _config.yml (Jupyter Book passes them on as the theme's
`repository_url` and `repository_branch`).
"""

from __future__ import annotations

from html import escape

CHAPTER_PREFIX = "chapters/"


def colab_url(repository_url: str, branch: str, chapter: str) -> str:
    repo = repository_url.rstrip("/").removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{chapter}.ipynb"


def add_colab_link(app, pagename, templatename, context, doctree):
    if not pagename.startswith(CHAPTER_PREFIX) or "body" not in context:
        return
    options = app.config.html_theme_options
    url = colab_url(
        options["repository_url"],
        options.get("repository_branch") or "main",
        pagename.removeprefix(CHAPTER_PREFIX),
    )
    badge = (
        f'<p class="colab-link"><a href="{escape(url)}" target="_blank" rel="noopener">'
        "Open this chapter in Colab</a> "
        "(runs top to bottom; choose a GPU runtime for the larger sizes)</p>\n"
    )
    context["body"] = badge + context["body"]


def setup(app):
    app.connect("html-page-context", add_colab_link)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
