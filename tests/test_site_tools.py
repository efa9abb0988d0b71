"""The API reference generator (tools/api_reference.py) and the browser check of the built site
(tools/site_check.py)."""

import importlib
import re
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import api_reference  # noqa: E402
import site_check  # noqa: E402

import attnbook  # noqa: E402

# --- API reference -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_page():
    text, problems = api_reference.generate()
    return text, problems


def test_every_public_name_is_on_the_page_with_a_chapter(api_page):
    text, problems = api_page
    assert problems == []
    for module_name in attnbook.__all__:
        module = importlib.import_module(f"attnbook.{module_name}")
        assert f"## `attnbook.{module_name}`" in text
        for name in module.__all__:
            label = api_reference.label(module_name, name)
            block = text.split(f"({label})=\n", 1)[1].split("\n(api-", 1)[0]
            assert block.startswith(f"### `{name}`")
            assert "Built in " in block
            assert f"from attnbook.{module_name} import {name}" in block


def test_links_point_at_chapter_sections(api_page):
    text, _ = api_page
    links = re.findall(r"\]\(\.\./(chapters/[^)#]+\.md)(?:#([^)]+))?\)", text)
    assert links, "no link to a chapter"
    published = api_reference.published_chapters()
    for path, _anchor in links:
        assert (ROOT / path).is_file()
        assert path.removesuffix(".md") in published


def test_a_signature_and_docstring_come_from_the_package(api_page):
    text, _ = api_page
    from attnbook.attention import scaled_dot_product_attention

    first_line = scaled_dot_product_attention.__doc__.strip().splitlines()[0]
    block = text.split("### `scaled_dot_product_attention`", 1)[1].split("\n### ", 1)[0]
    assert "def scaled_dot_product_attention(" in block
    assert api_reference.escape(first_line).replace("\\", "") in block.replace("\\", "")


def test_heading_anchors_follow_myst():
    md = api_reference.heading_parser({"myst_enable_extensions": ["dollarmath"]})
    found = api_reference.headings(md, "# Title\n\n## Why $\\sqrt{d}$?\n\n## `softmax`, again\n")
    assert [(level, slug_text) for level, _, slug_text in found] == [
        (1, "Title"), (2, "Why ?"), (2, "softmax, again"),
    ]
    from myst_parser.mdit_to_docutils.base import default_slugify

    assert default_slugify("Why ?") == "why-"
    assert default_slugify("softmax, again") == "softmax-again"


def test_docstrings_are_shown_as_written():
    doc = "Takes **kwargs and x[i], $5 <b> {role}`x` and `code_span*`\n\nReturns\n-------\nint"
    html = MarkdownIt("commonmark").render(api_reference.docstring_markdown(doc))
    assert "<strong>" not in html and "<h2>" not in html and "<b>" not in html
    assert "**kwargs and x[i], $5 &lt;b&gt; {role}" in html
    assert "<code>code_span*</code>" in html
    indented = api_reference.docstring_markdown("Example:\n\n    f(1)\n    f(2)")
    assert "```python\nf(1)\nf(2)\n```" in indented


def test_a_name_without_a_chapter_cell_is_a_problem(monkeypatch):
    monkeypatch.setattr(api_reference, "export_sections", lambda chapters: ({}, {}))
    _, problems = api_reference.generate()
    assert "attnbook.attention.softmax: no export cell defines it" in problems


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
