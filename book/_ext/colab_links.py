"""Sphinx extension: what every chapter page offers besides its text.

- An "Open in Colab" badge at the top of the page (the image is book/_static/colab-badge.svg,
  served by the site itself). It opens the chapter's generated notebook,
  notebooks/<chapter>.ipynb, in the repository and branch named once in _config.yml (Jupyter
  Book passes them on as the theme's `repository_url` and `repository_branch`).
- That same executed notebook in the page's download menu, next to the .md source and the
  print-to-PDF entry that sphinx-book-theme offers: the theme offers a notebook only when a launch
  button is configured, and then the one myst-nb executed for the site, not the committed one.
  It is copied into the site as _sources/chapters/<chapter>.ipynb, beside the .md source.

tools/site_check.py checks both on every chapter page of the built site.
"""

from __future__ import annotations

import shutil
from html import escape
from pathlib import Path

CHAPTER_PREFIX = "chapters/"
STATIC = Path(__file__).resolve().parents[1] / "_static"  # book/_static
BADGE = "colab-badge.svg"


def colab_url(repository_url: str, branch: str, chapter: str) -> str:
    repo = repository_url.rstrip("/").removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{chapter}.ipynb"


def serve_static(app, config) -> None:
    """Serve book/_static (the badge, the favicon) as part of the site's _static folder."""
    config.html_static_path = [*config.html_static_path, str(STATIC)]


def add_colab_badge(app, pagename, templatename, context, doctree) -> None:
    if not pagename.startswith(CHAPTER_PREFIX) or "body" not in context:
        return
    options = app.config.html_theme_options
    url = colab_url(
        options["repository_url"],
        options.get("repository_branch") or "main",
        pagename.removeprefix(CHAPTER_PREFIX),
    )
    image = context["pathto"](f"_static/{BADGE}", 1)
    badge = (
        f'<p class="colab-link"><a href="{escape(url)}" target="_blank" rel="noopener">'
        f'<img src="{escape(image)}" alt="Open in Colab" width="117" height="20" '
        'style="vertical-align: middle"></a> '
        "(runs top to bottom; choose a GPU runtime for the larger sizes)</p>\n"
    )
    context["body"] = badge + context["body"]


def add_notebook_download(app, pagename, templatename, context, doctree) -> None:
    """Put notebooks/<chapter>.ipynb first in the download menu (after the theme has built it)."""
    notebook = Path(app.srcdir) / "notebooks" / f"{pagename.removeprefix(CHAPTER_PREFIX)}.ipynb"
    if not pagename.startswith(CHAPTER_PREFIX) or not notebook.is_file():
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(notebook, target)
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            buttons = [b for b in group["buttons"] if b.get("text") != ".ipynb"]
            group["buttons"] = [{
                "type": "link",
                "url": f"{context['pathto']('_sources', 1)}/{pagename}.ipynb",
                "text": ".ipynb",
                "tooltip": "Download the executed notebook (the one Colab opens)",
                "icon": "fas fa-code",
                "label": "download-notebook-button",
            }, *buttons]


def setup(app):
    app.connect("config-inited", serve_static)
    app.connect("html-page-context", add_colab_badge)
    # After sphinx-book-theme's add_header_buttons (priority 501) has made the download menu.
    app.connect("html-page-context", add_notebook_download, priority=600)
    return {"version": "1.1", "parallel_read_safe": True, "parallel_write_safe": True}
