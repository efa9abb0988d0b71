"""The API reference generator (tools/api_reference.py) and the browser check of the built site
(tools/site_check.py)."""

import asyncio
import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import api_reference  # noqa: E402
import book_pdf  # noqa: E402
import site_check  # noqa: E402

import attnbook  # noqa: E402

# --- API reference -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_page():
    text, problems = api_reference.generate()
    return text, problems


def entries(text: str) -> dict[str, tuple[str, str | None]]:
    """{attnbook.module.name: (its directive, its built-in target)} on the generated page."""
    found, module, current = {}, None, None
    for line in text.splitlines():
        if match := re.fullmatch(r"\.\. automodule:: (\S+)", line):
            module = match.group(1)
        elif match := re.fullmatch(r"\.\. (auto\w+|py:class):: (\S+)", line):
            name = match.group(2)
            current = name if name.startswith("attnbook.") else f"{module}.{name}"
            found[current] = (match.group(1), None)
        elif match := re.fullmatch(r" {3}\.\. built-in:: (\S+)", line):
            found[current] = (found[current][0], match.group(1))
    return found


def test_every_public_name_has_an_autodoc_entry_and_a_chapter(api_page):
    text, problems = api_page
    assert problems == []
    found = entries(text)
    kinds = {"autofunction": "function", "autoclass": "class", "py:class": "class"}
    for module_name in attnbook.__all__:
        module = importlib.import_module(f"attnbook.{module_name}")
        assert f"## `attnbook.{module_name}`" in text
        for name in module.__all__:
            kind, target = found.pop(f"attnbook.{module_name}.{name}")
            obj = getattr(module, name)
            expected = "class" if isinstance(obj, type) else "function" if callable(obj) else None
            assert kinds.get(kind) == expected, (name, kind)
            assert target and target.startswith("chapters/"), name
    assert found == {}, "entries for names outside __all__"


def test_the_entries_name_chapter_headings_as_myst_slugs_them(api_page):
    text, _ = api_page
    from myst_parser.mdit_to_docutils.base import default_slugify

    md = api_reference.heading_parser(api_reference.sphinx_config())
    targets = {target for _, target in entries(text).values()}
    assert "chapters/01-queries-keys-values#scaling-batches-and-masks" in targets
    for target in targets:
        doc, _, anchor = target.partition("#")
        path = ROOT / f"{doc}.md"
        assert path.is_file(), target
        slugs = {default_slugify(s) for level, _, s in api_reference.headings(
            md, path.read_text()) if level <= 2}
        assert not anchor or anchor.rsplit("-", 1)[0] in slugs or anchor in slugs, target


def test_constants_too_long_or_not_reproducible_are_shown_without_a_value():
    assert api_reference.directive("x", "SMALL", {"a": 1}) == [".. autodata:: attnbook.x.SMALL"]
    assert api_reference.directive("x", "BIG", list(range(200)))[1] == "   :no-value:"
    assert api_reference.directive("x", "FN", {"f": object()})[1] == "   :no-value:"


def test_heading_anchors_follow_myst():
    md = api_reference.heading_parser({"myst_enable_extensions": ["dollarmath"]})
    found = api_reference.headings(md, "# Title\n\n## Why $\\sqrt{d}$?\n\n## `softmax`, again\n")
    assert [(level, slug_text) for level, _, slug_text in found] == [
        (1, "Title"), (2, "Why ?"), (2, "softmax, again"),
    ]
    from myst_parser.mdit_to_docutils.base import default_slugify

    assert default_slugify("Why ?") == "why-"
    assert default_slugify("softmax, again") == "softmax-again"


def test_a_name_without_a_chapter_cell_is_a_problem(monkeypatch):
    monkeypatch.setattr(api_reference, "export_sections", lambda chapters: {})
    text, problems = api_reference.generate()
    assert "attnbook.attention.softmax: no export cell defines it" in problems
    assert "built-in::" not in text


# --- the API page built by Sphinx, on a small book of two pages ----------------------------------

CHAPTER = """# Softmax

## Scores and weights

The weights come from {py:func}`attnbook.attention.softmax`.

```python
import numpy as np
from attnbook.attention import softmax

weights = softmax(np.zeros(3))
```
"""


def build_small_book(tmp_path: Path, api: str) -> tuple[Path, str]:
    """Build chapters/01-queries-keys-values.md and book/api.md with the book's own autodoc and
    sphinx-codeautolink settings (from _config.yml) and book/_ext; (the HTML, the warnings)."""
    import io

    import yaml
    from sphinx.application import Sphinx

    src = tmp_path / "src"
    (src / "chapters").mkdir(parents=True)
    (src / "book").mkdir()
    (src / "chapters" / "01-queries-keys-values.md").write_text(CHAPTER)
    (src / "book" / "api.md").write_text(api)
    (src / "index.md").write_text("# Book\n\n```{toctree}\nchapters/01-queries-keys-values\n"
                                  "book/api\n```\n")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    book = config["sphinx"]
    settings = {k: v for k, v in book["config"].items()
                if k.startswith(("autodoc_", "codeautolink_", "nitpick", "myst_heading", "sitemap_"))
                or k in ("add_module_names", "default_role", "toc_object_entries_show_parents")}
    settings["html_baseurl"] = config["html"]["baseurl"]  # sphinx-sitemap's base
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
        f"extensions = ['myst_parser', *{book['extra_extensions']!r}, 'api_sections']\n"
        + "".join(f"{k} = {v!r}\n" for k, v in settings.items())
    )
    warnings = io.StringIO()
    app = Sphinx(src, src, tmp_path / "html", tmp_path / "doctrees", "html",
                 status=None, warning=warnings, freshenv=True, keep_going=True)
    app.config.nitpicky = True
    app.build()
    return tmp_path / "html", warnings.getvalue()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_entries_are_python_objects_linked_to_their_section_and_from_code(tmp_path, monkeypatch):
    from sphinx_codeautolink import extension

    from attnbook.compile_check import GPUS

    resolved, resolve = [], extension.resolve_location  # the names codeautolink follows
    monkeypatch.setattr(extension, "resolve_location",
                        lambda name, inventory: resolved.append(name.import_components[0])
                        or resolve(name, inventory))

    rst = [".. automodule:: attnbook.attention", "",
           *api_reference.directive("attention", "softmax", attnbook.attention.softmax), "",
           "   .. built-in:: chapters/01-queries-keys-values#scores-and-weights", "",
           ".. automodule:: attnbook.compile_check", "",
           *api_reference.directive("compile_check", "GPUS", GPUS), "",
           "   .. built-in:: chapters/99-not-written#anything"]
    api = "# API\n\n```{eval-rst}\n" + "\n".join(rst) + "\n```\n"
    html, warnings = build_small_book(tmp_path, api)
    assert warnings == ""
    objects = api_reference.inventory(html)
    assert objects["attnbook.attention.softmax"] == "py:function"
    assert objects["attnbook.attention"] == "py:module"
    assert objects["attnbook.compile_check.GPUS"] == "py:data"
    page = (html / "book" / "api.html").read_text()
    links = api_reference.entry_links(page)
    assert links["attnbook.attention.softmax"] == [
        "../chapters/01-queries-keys-values.html",
        "../chapters/01-queries-keys-values.html#scores-and-weights",
    ]
    assert links["attnbook.compile_check.GPUS"] == []  # a chapter not on the site: no link
    assert re.search(r"99-not-written\.md</span></code> \(not yet on this site\)", page)
    assert "dict() -&gt; new empty dictionary" not in page  # not dict's docstring as GPUS's
    code = (html / "chapters" / "01-queries-keys-values.html").read_text()
    assert "attnbook.attention.softmax" in api_reference.code_links(code)
    # only the package's names are followed (api_sections.only_package_names): np.zeros, which
    # no entry documents, is left unresolved
    assert set(resolved) == {"attnbook"}, resolved
    overloaded = ('<dt class="sig sig-object py" id="m.f">f(x: int)</dt>'
                  '<dt class="sig sig-object py">f(x: str)</dt>'  # an @overload: no id
                  '<dd><p class="api-built-in"><a href="../chapters/c.html">c</a></p></dd>'
                  '<dt class="sig sig-object py" id="m.g">g()</dt><dd></dd>')
    assert api_reference.entry_links(overloaded) == {"m.f": ["../chapters/c.html"], "m.g": []}
    assert 'href="../book/api.html#attnbook.attention.softmax"' in code.split("<pre>")[0]  # prose


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_section_that_does_not_exist_fails_the_build(tmp_path):
    api = ("# API\n\n```{eval-rst}\n.. autofunction:: attnbook.attention.softmax\n\n"
           "   .. built-in:: chapters/01-queries-keys-values#no-such-heading\n```\n")
    _, warnings = build_small_book(tmp_path, api)
    assert "local id not found" in warnings and "no-such-heading" in warnings


# --- site check: the parts that need no browser --------------------------------------------------


def test_colab_links_must_name_existing_notebooks(tmp_path):
    (tmp_path / "01-queries-keys-values.ipynb").write_text("{}")
    good = site_check.expected_colab("chapters/01-queries-keys-values.html")
    result = site_check.PageResult("chapters/01-queries-keys-values.html")
    site_check.check_colab(result, [good], tmp_path)
    assert result.problems == []

    result = site_check.PageResult("chapters/02-scaling.html")
    site_check.check_colab(result, [site_check.expected_colab(result.path)], tmp_path)
    assert any("does not exist" in p for p in result.problems)

    result = site_check.PageResult("chapters/02-scaling.html")
    site_check.check_colab(result, [], tmp_path)
    assert result.problems == ["chapter page has no Colab link (class colab-link)"]


def test_links_and_anchors_are_resolved(tmp_path):
    (tmp_path / "a.html").write_text("<p>a</p>")
    base = "http://127.0.0.1:1"
    result = site_check.PageResult("b.html")
    for href in ["a.html#here", "a.html#gone", "missing.html", "https://example.org/x"]:
        site_check.resolve_link(result, {"href": f"{base}/{href}" if "://" not in href else href,
                                         "raw": href}, base, tmp_path)
    target = site_check.PageResult("a.html", ids={"here"})
    site_check.check_fragments([result, target])
    assert result.links == 3
    assert result.problems == [
        "broken link 'missing.html': missing.html does not exist",
        "broken anchor 'a.html#gone': a.html has no id 'gone'",
    ]


def test_a_link_to_a_file_written_later_is_checked_by_its_name(tmp_path):
    base, later = "http://127.0.0.1:1", frozenset({"book.pdf"})
    result = site_check.PageResult("b.html")
    for href in ["book.pdf", "books.pdf"]:  # the PDF make test prints while the site is checked
        site_check.resolve_link(result, {"href": f"{base}/{href}", "raw": href}, base, tmp_path,
                                later)
    assert result.links == 2
    assert result.problems == ["broken link 'books.pdf': books.pdf does not exist"]


def test_execution_table_needs_a_time_for_every_chapter(tmp_path):
    (tmp_path / "chapters").mkdir()
    for name in ("01-a", "02-b", "03-c"):
        (tmp_path / "chapters" / f"{name}.html").write_text("")
    table = {
        "head": ["Document", "Modified", "Method", "Run Time (s)", "Status"],
        "rows": [["chapters/01-a", "", "cache", "1.5", "\u2705"],
                 ["chapters/02-b", "", "cache", "-", "\u274c"]],
    }
    result = site_check.PageResult("book/execution.html")
    site_check.check_execution_table(result, table, tmp_path)
    assert result.problems == [
        "execution table: chapters/02-b has no run time ('-')",
        "execution table: chapters/02-b did not run cleanly ('\u274c')",
        "execution table has no row for chapters/03-c",
    ]


# --- site check in the browser, on a small site with one of each problem -------------------------

BAD_PAGE = """<!DOCTYPE html><html><head>
<script>console.error("something broke")</script>
<script src="https://cdn.example.org/lib.js"></script>
</head><body>
<p>Inline <span class="math">\\(x^2\\)</span> never typeset.</p>
<img src="missing.png" alt="">
<a href="good.html#there">ok</a> <a href="good.html#nowhere">bad anchor</a>
<a href="nothing.html">broken</a>
<p class="colab-link"><a href="https://colab.research.google.com/github/o/r/blob/main/notebooks/99-x.ipynb">Colab</a></p>
</body></html>"""
GOOD_PAGE = """<!DOCTYPE html><html><body><h1 id="there">Fine</h1>
<img src="pixel.gif" alt=""><a href="bad.html">back</a></body></html>"""
PIXEL = bytes.fromhex("47494638396101000100800000ffffff00000021f90401000000002c00000000010001000002024401003b")


@pytest.mark.skipif(not site_check.find_chromium(), reason="no Chromium (make site-check installs it)")
def test_the_browser_check_finds_each_kind_of_problem(tmp_path):
    site = tmp_path / "html"
    site.mkdir()
    (site / "index.html").write_text('<meta http-equiv="Refresh" content="0; url=good.html" />')
    (site / "bad.html").write_text(BAD_PAGE)
    (site / "good.html").write_text(GOOD_PAGE)
    (site / "pixel.gif").write_bytes(PIXEL)
    results = {r.path: r for r in site_check.run(site, tmp_path, None)}
    assert results["good.html"].problems == [] and results["index.html"].problems == []
    problems = "\n".join(results["bad.html"].problems)
    for expected in [
        "console error: something broke",
        "requests something outside the site: https://cdn.example.org/lib.js",
        "math not typeset: '\\\\(x^2\\\\)'",
        "raw TeX left in the text",
        "image did not load",
        "broken anchor 'good.html#nowhere'",
        "broken link 'nothing.html'",
        "names notebooks/99-x.ipynb, which does not exist",
        "Colab link on a page that is not a chapter",
    ]:
        assert expected in problems


# --- the attention explorer (attnbook.viz) in the browser ----------------------------------------


def explorer_page(*explorers: str) -> str:
    return f"<!DOCTYPE html><html><body>{''.join(explorers)}</body></html>"


@pytest.mark.skipif(not site_check.find_chromium(), reason="no Chromium (make site-check installs it)")
def test_the_browser_check_tries_each_explorer(tmp_path):
    from attnbook.attention import softmax
    from attnbook.viz import attention_explorer

    scores = np.random.default_rng(0).normal(size=(2, 4, 4)) * 3
    tokens = ["<b>", "keys", "to", "car"]
    working = attention_explorer(tokens, softmax(scores))._repr_html_()
    site = tmp_path / "html"
    site.mkdir()
    (site / "index.html").write_text(explorer_page(
        working, attention_explorer(tokens[:2], np.eye(2))._repr_html_()))
    dead = re.sub(r"<script>.*?</script>", "", working, flags=re.DOTALL)  # no program
    same_heads = attention_explorer(tokens, softmax(np.stack([scores[0]] * 2)))._repr_html_()
    (site / "broken.html").write_text(explorer_page(dead, same_heads))
    (site / "twice.html").write_text(explorer_page(working, working))
    results = {r.path: r for r in site_check.run(site, tmp_path, None)}
    assert results["index.html"].problems == []
    broken = "\n".join(results["broken.html"].problems)
    dead_id, same_id = (re.search(r'id="([^"]+)"', html).group(1) for html in (dead, same_heads))
    assert f"attention explorer {dead_id}: focusing token 0 changes nothing" in broken
    assert f"attention explorer {dead_id}: token 3 shows [" in broken  # no values written
    assert f"attention explorer {same_id}: every head shows the same picture" in broken
    assert same_id + ": focusing" not in broken and same_id + ": token" not in broken
    assert "attention explorers without distinct ids" in "\n".join(results["twice.html"].problems)


# --- downloads, buttons, canonical links and the sitemap, on pages made up here -------------------

CONFIG = site_check.SiteConfig("https://github.com/o/r", "main", "https://o.github.io/r/",
                               frozenset({"chapters/01-a.md"}))
BASE = "http://127.0.0.1:1"


def page_info(**changes) -> dict:
    info = {"canonical": ["https://o.github.io/r/chapters/01-a.html"],
            "icons": [{"href": f"{BASE}/_static/favicon.svg", "raw": "../_static/favicon.svg"}],
            "issues": ["https://github.com/o/r/issues/new?title=x"],
            "edit": ["https://github.com/o/r/edit/main/chapters/01-a.md"],
            "downloads": [{"text": ".ipynb", "href": f"{BASE}/_sources/chapters/01-a.ipynb"},
                          {"text": ".md", "href": f"{BASE}/_sources/chapters/01-a.md"}]}
    return {**info, **changes}


def made_up_site(tmp_path) -> Path:
    site = tmp_path / "html"
    (site / "_sources" / "chapters").mkdir(parents=True)
    (site / "_static").mkdir()
    (site / "_static" / "favicon.svg").write_text("<svg/>")
    (site / "_sources" / "chapters" / "01-a.md").write_text("# A")
    return site


def test_buttons_canonical_link_and_favicon(tmp_path):
    site = made_up_site(tmp_path)
    result = site_check.PageResult("chapters/01-a.html")
    site_check.check_buttons(result, page_info(), BASE, site, CONFIG)
    assert result.problems == []

    result = site_check.PageResult("chapters/01-a.html")
    site_check.check_buttons(result, page_info(
        canonical=[], icons=[{"href": "https://cdn.example.org/i.png", "raw": "x"}], issues=[],
        edit=["https://github.com/o/r/edit/main/chapters/01-b.md"]), BASE, site, CONFIG)
    assert result.problems == [
        "canonical link is [], not ['https://o.github.io/r/chapters/01-a.html']",
        "favicon is not served by the site: x",
        "no 'Open an issue' button for https://github.com/o/r: []",
        "edit buttons ['https://github.com/o/r/edit/main/chapters/01-b.md'] do not open "
        "chapters/01-a.md",
    ]
    (site / "_sources" / "book").mkdir()
    (site / "_sources" / "book" / "api.md").write_text("generated")
    result = site_check.PageResult("book/api.html")
    site_check.check_buttons(result, page_info(
        canonical=["https://o.github.io/r/book/api.html"],
        edit=["https://github.com/o/r/edit/main/book/api.md"]), BASE, site, CONFIG)
    assert result.problems == ["edit button on a page with no file to edit: "
                               "['https://github.com/o/r/edit/main/book/api.md']"]


def test_downloads_must_be_the_committed_files(tmp_path):
    site = made_up_site(tmp_path)
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    chapter = site_check.ROOT / "chapters" / "01-queries-keys-values.md"
    (notebooks / "01-queries-keys-values.ipynb").write_text('{"cells": []}')
    served = site / "_sources" / "chapters"
    (served / "01-queries-keys-values.md").write_bytes(chapter.read_bytes())
    (served / "01-queries-keys-values.ipynb").write_text('{"cells": []}')
    downloads = [{"text": s, "href": f"{BASE}/_sources/chapters/01-queries-keys-values{s}"}
                 for s in (".ipynb", ".md")]
    result = site_check.PageResult("chapters/01-queries-keys-values.html")
    site_check.check_downloads(result, downloads, BASE, site, notebooks)
    assert result.problems == []

    (served / "01-queries-keys-values.ipynb").write_text('{"cells": [], "stale": 1}')
    site_check.check_downloads(result, downloads[1:], BASE, site, notebooks)
    site_check.check_downloads(result, downloads, BASE, site, notebooks)
    assert result.problems == [
        "download menu offers [] as .ipynb, not one file of the site",
        f"the .ipynb download is not the file {notebooks / '01-queries-keys-values.ipynb'}",
    ]


def test_the_sitemap_lists_every_chapter_and_only_pages(tmp_path):
    site = made_up_site(tmp_path)
    (site / "chapters").mkdir()
    (site / "chapters" / "01-a.html").write_text("")
    pages = [site_check.PageResult("chapters/01-a.html"), site_check.PageResult("chapters/02-b.html")]
    (site / "sitemap.xml").write_text(
        "<urlset><url><loc>https://o.github.io/r/chapters/01-a.html</loc></url>"
        "<url><loc>https://o.github.io/r/chapters/09-gone.html</loc></url>"
        "<url><loc>https://elsewhere.org/chapters/01-a.html</loc></url></urlset>")
    assert site_check.check_sitemap(site, CONFIG, pages).problems == [
        "lists https://o.github.io/r/chapters/09-gone.html, which is not a page under "
        "https://o.github.io/r/",
        "lists https://elsewhere.org/chapters/01-a.html, which is not a page under "
        "https://o.github.io/r/",
        "does not list chapters/02-b.html",
    ]
    (site / "sitemap.xml").unlink()
    assert site_check.check_sitemap(site, CONFIG, pages).problems == ["the site has no sitemap.xml"]


def test_the_published_site_is_where_the_repository_says():
    config = site_check.site_config()
    owner, name = config.repository.removeprefix("https://github.com/").split("/")
    assert config.baseurl == f"https://{owner}.github.io/{name}/"
    assert "book/_static/favicon.svg" in config.tracked or (
        site_check.ROOT / "book" / "_static" / "favicon.svg").is_file()


# --- make pdf: the book printed by Chromium ------------------------------------------------------


def test_pages_are_counted_from_the_page_objects():
    pdf = b"<< /Type /Pages /Count 2 >> << /Type /Page >> << /Type/Page /Parent 1 0 R >>"
    assert book_pdf.page_count(pdf) == 2


@pytest.mark.skipif(not site_check.find_chromium(), reason="no Chromium (make site-check installs it)")
def test_the_book_page_is_printed_as_sphinx_wrote_its_links(tmp_path):
    # singlehtml writes the root document (book/intro.html) with links relative to the top folder
    site = tmp_path / "singlehtml"
    (site / "book").mkdir(parents=True)
    (site / "_images").mkdir()
    (site / "_images" / "pixel.gif").write_bytes(PIXEL)
    (site / "index.html").write_text('<meta http-equiv="Refresh" content="0; url=book/intro.html" />')
    body = '<section><h1>Intro</h1><img src="_images/pixel.gif" alt=""></section>' + "".join(
        f'<span id="document-ch{i}"></span><section><h1>Chapter {i}</h1>'
        f'<img src="_images/pixel.gif" alt=""></section>' for i in (1, 2))
    (site / "book" / "intro.html").write_text(f"<!DOCTYPE html><html><body>{body}"
                                              '<p class="book-pdf">not printed</p></body></html>')
    out = tmp_path / "book.pdf"
    server, base = site_check.serve(site)
    try:
        info, outside = asyncio.run(book_pdf.print_pdf(
            site_check.ensure_chromium(), base, book_pdf.book_page(site), out))
    finally:
        server.shutdown()
        server.server_close()
    assert outside == [] and info["images"] == 3 and info["broken"] == []
    assert book_pdf.page_count(out.read_bytes()) == 3  # each document on a page of its own


def test_a_chapter_figure_carries_its_own_number_and_no_second_one():
    own = ('<figure><img alt="x"><figcaption><p><span class="caption-text">Figure 5.3. RoPE in '
           'one plane.</span></p></figcaption></figure>')
    twice = own.replace('<p><span class="caption-text">',
                        '<p><span class="caption-number">Fig. 13 </span><span class="caption-text">')
    bare = own.replace("Figure 5.3. ", "")
    appendix = own.replace("Figure 5.3.", "Figure B.1.")
    for html, problems in [
        (own, []), (appendix, []),
        (twice, ["figure numbered twice: 'Fig. 13 Figure 5.3. RoPE in one plane.'"]),
        (bare, ["figure caption without its number: 'RoPE in one plane.'"]),
    ]:
        result = site_check.PageResult("chapters/05-positions.html")
        site_check.check_figures(result, html)
        assert result.problems == problems
