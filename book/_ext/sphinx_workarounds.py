"""Sphinx extension: workarounds for what Sphinx and the theme show or log on every page.

- Sphinx 7.4 writes a script that has a body and no file twice when an extension adds it after
  the builder starts (sphinx-thebe does), so the browser raises "Identifier 'THEBE_JS_URL' has
  already been declared" on every page. Each page keeps the first copy of such a script.
- pydata-sphinx-theme logs "Got invalid theme mode" on a reader's first visit when no
  `default_mode` is set; it is set to "auto" (follow the reader's system), the theme's fallback.

sitemap.xml is sphinx-sitemap's (_config.yml: html.baseurl, sitemap_url_scheme), and every page's
canonical link is Sphinx's own, from the same html.baseurl.

tools/site_check.py (make site-check) checks each of these on the built pages.
"""

from __future__ import annotations


def set_default_mode(app, config) -> None:
    context = dict(config.html_context or {})  # where pydata-sphinx-theme reads it from
    context.setdefault("default_mode", "auto")
    config.html_context = context


def drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        attributes = getattr(script, "attributes", {}) or {}
        key = (getattr(script, "filename", str(script)) or "", tuple(sorted(attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("config-inited", set_default_mode)
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
