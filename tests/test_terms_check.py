"""tools/terms_check.py: a glossary term used before its chapter must be linked at first use."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import terms_check  # noqa: E402

GLOSSARY = """# Glossary

```{glossary}
KV cache
  Keys and values kept for generation.
  Defined in [chapter 4](../chapters/04-later.md).

token
  A unit of text.
  Defined in [chapter 1](../chapters/01-first.md).
```
"""


def book(tmp_path: Path, early: str) -> Path:
    (tmp_path / "book").mkdir()
    (tmp_path / "chapters").mkdir()
    (tmp_path / "book" / "glossary.md").write_text(GLOSSARY)
    (tmp_path / "chapters" / "01-first.md").write_text(early)
    (tmp_path / "chapters" / "04-later.md").write_text("# Later\n\nThe KV cache is built here.\n")
    return tmp_path


def run(root: Path, *argv: str) -> int:
    return terms_check.main(list(argv), root=root)


def test_an_unlinked_use_before_the_defining_chapter_fails(tmp_path, capsys):
    root = book(tmp_path, "# First\n\nA model keeps a KV cache. Tokens come first.\n")
    assert run(root) == 1
    assert "chapters/01-first.md:3: 'KV cache' used before" in capsys.readouterr().err


def test_a_linked_first_use_passes_and_later_uses_need_no_link(tmp_path):
    root = book(tmp_path, "# First\n\nA {term}`KV caches <KV cache>` store. The KV cache again.\n")
    assert run(root) == 0


def test_code_math_headings_and_roles_are_not_prose(tmp_path):
    early = ("# The KV cache\n\n`kv cache` and $KV cache$ and {cite}`KV cache`.\n\n"
             "```{code-cell} ipython3\nkv_cache = 'KV cache'\n```\n\n## KV cache heading\n")
    assert run(book(tmp_path, early)) == 0


def test_fix_links_the_first_plain_use_once_and_is_idempotent(tmp_path):
    root = book(tmp_path, "# First\n\nTwo KV caches here, and a KV cache there.\n")
    assert run(root, "--fix") == 0
    fixed = (root / "chapters" / "01-first.md").read_text()
    assert fixed == "# First\n\nTwo {term}`KV caches <KV cache>` here, and a KV cache there.\n"
    assert run(root, "--fix") == 0 and (root / "chapters" / "01-first.md").read_text() == fixed
    assert run(root) == 0


def test_a_glossary_entry_without_its_chapter_is_an_error(tmp_path):
    root = book(tmp_path, "# First\n")
    (root / "book" / "glossary.md").write_text("```{glossary}\nterm\n  No chapter.\n```\n")
    try:
        run(root)
    except ValueError as error:
        assert "glossary entry 'term' links to no chapter" in str(error)
    else:
        raise AssertionError("accepted an entry without its chapter")


def test_the_book_itself_links_every_early_use():
    assert terms_check.main([]) == 0
