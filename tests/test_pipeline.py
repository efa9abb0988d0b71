"""The tangler and the sync check, run on a copy of the repository."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))
import tangle as tangler  # noqa: E402
from colab_links import colab_url  # noqa: E402


def copy_book(to: Path, chapters: tuple[str, ...] | None = None) -> Path:
    """A copy of the book in `to`: the chapters named (all of them if None), their notebooks, the
    tools and the package, tangled so that the package holds the chapters' modules alone."""
    for name in ["chapters", "tools", "code", "notebooks"]:
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ["_config.yml", "pyproject.toml", "book/references.bib"]:
        (to / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, to / name)
    if chapters is not None:
        for chapter in (to / "chapters").glob("*.md"):
            if chapter.stem not in chapters:
                chapter.unlink()
                (to / "notebooks" / f"{chapter.stem}.ipynb").unlink()
        assert tangle(to).returncode == 0  # the other chapters' modules go
    return to


# The chapters the tests below edit, appendix A (the glue the notebooks use) and appendix H (the
# checks every module uses). Each tangle of the whole book takes seconds, and these tests tangle
# 30 times.
SMALL_BOOK = ("01-queries-keys-values", "06-masks", "a1-conventions", "a8-argument-checks")


@pytest.fixture(scope="module")
def small_book(tmp_path_factory):
    """The small book, copied and tangled once for the module (a copy and a tangle take
    seconds); no test edits it: each takes a copy of it, book_copy."""
    return copy_book(tmp_path_factory.mktemp("small-book"), SMALL_BOOK)


@pytest.fixture
def book_copy(small_book, tmp_path):
    """A copy of the small book of this test's own, in tmp_path, as copy_book leaves it."""
    shutil.copytree(small_book, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


def tangle(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "tools" / "tangle.py"), *args],
        capture_output=True, text=True, cwd=root,
    )


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for folder in ("code", "notebooks")
        for p in sorted((root / folder).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_tangling_is_deterministic_and_keeps_outputs(tmp_path):
    # The committed code/ and notebooks/ were written by an earlier run of the tangler (another
    # process, another day): one run here that writes the same bytes is a second run that agrees.
    book = copy_book(tmp_path)  # the whole book
    before = snapshot(book)
    assert tangle(book).returncode == 0
    assert snapshot(book) == before


def test_check_fails_on_an_edited_chapter(book_copy):
    chapter = book_copy / "chapters" / "01-queries-keys-values.md"
    text = chapter.read_text()
    chapter.write_text(text.replace("def softmax(", "def softmax_renamed(", 1))
    result = tangle(book_copy, "--check")
    assert result.returncode == 1
    assert "code/attnbook/attention.py: differs from its chapter" in result.stderr
    assert "notebooks/01-queries-keys-values.ipynb: out of date" in result.stderr


def test_check_fails_on_hand_edits_and_untracked_files(book_copy):
    module = book_copy / "code" / "attnbook" / "attention.py"
    module.write_text(module.read_text() + "\nEXTRA = 1\n")
    (book_copy / "code" / "attnbook" / "stray.py").write_text("x = 1\n")
    result = tangle(book_copy, "--check")
    assert result.returncode == 1
    assert "attention.py: differs" in result.stderr
    assert "stray.py: not produced by any chapter" in result.stderr


def test_modules_say_where_they_come_from():
    for module in (ROOT / "code" / "attnbook").glob("*.py"):
        first_line = module.read_text().splitlines()[0]
        assert first_line.startswith("# Do not edit: tools/tangle.py generates this file from ")


def test_notebooks_install_the_package_alone_from_their_branch():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        setup = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert 'f"attnbook @ git+' + config["url"] + '@{REF}"' in setup, path
        assert "[notebook]" not in setup and "myst" not in setup, path  # no book toolchain
        assert tangler.installed_ref(nbformat.read(path, as_version=4)) == config["branch"], path


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_a_commit_of_the_package_needs_no_second_commit(book_copy):
    git(book_copy, "init", "-q")
    git(book_copy, "add", "-A")
    git(book_copy, "commit", "-qm", "book")
    assert tangle(book_copy, "--check").returncode == 0
    # A commit that changes the package (here its metadata, which no notebook shows) ...
    (book_copy / "pyproject.toml").write_text((book_copy / "pyproject.toml").read_text() + "\n")
    git(book_copy, "commit", "-qam", "change the package")
    # ... leaves the notebooks as they are: nothing to tangle, nothing to re-pin.
    before = snapshot(book_copy)
    assert tangle(book_copy).returncode == 0
    assert snapshot(book_copy) == before
    result = tangle(book_copy, "--check")
    assert result.returncode == 0, result.stderr


def test_a_new_setup_cell_keeps_the_notebooks_outputs(book_copy):
    """The setup cell is the tangler's, not the chapter's: rewriting it (here from the commit pin
    the notebooks once had) re-executes nothing and keeps every output."""
    notebook = book_copy / "notebooks" / "06-masks.ipynb"
    data = json.loads(notebook.read_text())
    outputs = [c.get("outputs") for c in data["cells"]]
    data["cells"][0]["source"] = ["# Setup. On Google Colab ...\n", 'COMMIT = "0d3536f"\n']
    notebook.write_text(json.dumps(data, indent=1) + "\n")
    assert "06-masks.ipynb: out of date" in tangle(book_copy, "--check").stderr
    assert tangle(book_copy).returncode == 0
    data = json.loads(notebook.read_text())
    assert 'REF = "main"\n' in data["cells"][0]["source"]
    assert [c.get("outputs") for c in data["cells"]] == outputs
    assert tangle(book_copy, "--check").returncode == 0


def test_the_site_copy_of_a_notebook_is_pinned_to_a_commit_with_its_outputs(tmp_path):
    copy = tmp_path / "06-masks.ipynb"
    shutil.copy(ROOT / "notebooks" / "06-masks.ipynb", copy)
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert tangle(ROOT, "--pin", sha, str(copy)).returncode == 0
    before = nbformat.read(ROOT / "notebooks" / "06-masks.ipynb", as_version=4)
    after = nbformat.read(copy, as_version=4)
    assert tangler.installed_ref(after) == sha
    assert after.cells[0].source == before.cells[0].source.replace('REF = "main"', f'REF = "{sha}"')
    assert after.cells[1:] == before.cells[1:] and after.cells[0].outputs == before.cells[0].outputs
    with pytest.raises(ValueError, match="commit must be a hexadecimal commit id"):
        tangler.pin(after, "main; rm -rf /")


def test_the_generated_files_are_listed_as_generated():
    """.gitattributes lists the committed files a command writes: every one tangle writes."""
    chapters = tangler.read_chapters()
    generated = [*tangler.package_files(chapters),
                 *(tangler.notebook_path(c).relative_to(ROOT).as_posix() for c in chapters),
                 "requirements.txt", "benchmarks/results/gpu-profile-on-cpu.json",
                 "tests/file-seconds.json",
                 *(p.relative_to(ROOT).as_posix() for p in (ROOT / ".github").glob("tested-*/*"))]
    written_by_hand = ["chapters/01-queries-keys-values.md", "tools/tangle.py", "requirements.in",
                       "code/attnbook/data/python-3.11.7-topics.json.gz", "Makefile"]
    found = subprocess.run(["git", "check-attr", "linguist-generated", "--", *generated,
                            *written_by_hand], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    marked = {line.split(": ")[0] for line in found if line.endswith(": set")}
    assert marked == set(generated)


def test_only_chapters_with_a_gpu_path_ask_colab_for_a_gpu():
    for chapter in tangler.read_chapters():
        metadata = json.loads(tangler.notebook_path(chapter).read_text())["metadata"]
        assert ("accelerator" in metadata) == chapter.wants_gpu, chapter.relpath
    wanting = {c.slug[:2] for c in tangler.read_chapters() if c.wants_gpu}
    assert "12" in wanting and "01" not in wanting


def test_every_gpu_chapter_has_a_current_gpu_profile_record():
    """make gpu-profile ran each gpu: true chapter, as it is now, with the GPU's sizes."""
    import gpu_chapters_on_cpu

    assert {p.stem for p in gpu_chapters_on_cpu.gpu_chapters()} == {
        c.slug for c in tangler.read_chapters() if c.wants_gpu}
    assert gpu_chapters_on_cpu.check(gpu_chapters_on_cpu.load()) == []


def test_the_gpu_profile_check_sees_a_stale_or_failed_record(tmp_path, monkeypatch):
    import gpu_chapters_on_cpu

    chapter = gpu_chapters_on_cpu.gpu_chapters()[0]
    fresh = {"source_sha256": gpu_chapters_on_cpu.sha256(chapter), "status": "ok"}
    assert not [p for p in gpu_chapters_on_cpu.check({"chapters": {chapter.stem: fresh}})
                if p.startswith(chapter.stem)]
    for entry, says in [(None, "no GPU-profile record"),
                        ({**fresh, "source_sha256": "0" * 64}, "changed since"),
                        ({**fresh, "status": {"failed_cell": 3}}, "failed")]:
        record = {"chapters": {} if entry is None else {chapter.stem: entry}}
        assert any(chapter.stem in p and says in p for p in gpu_chapters_on_cpu.check(record))


def test_no_glued_number_shows_digits_its_record_lacks():
    import glue_digits_check

    assert glue_digits_check.check_book() == []


@pytest.mark.parametrize("spec, value, digits, bad", [
    (".1%", "0.25", 2, True),     # 25.0%: three digits from two
    ("", "100.0", 2, True),       # 100.0: the format of the record itself
    (".2f", "1.0", 2, True),      # 1.00
    (".0%", "0.7", 1, False),     # 70%: a whole number's trailing zero places the point
    (".0f", "400.0", 2, False),   # 400
    (".0%", "0.65", 2, False),    # 65%
    (".1%", "0.999", 3, False),   # 99.9%
    (".2f", "0.25", 2, False),    # 0.25
    (".1e", "2.5e-07", 2, False), # 2.5e-07
    (",d", "1086", 4, False),     # 1,086
])
def test_glue_digits_check_catches_a_format_with_more_digits_than_the_record(spec, value, digits, bad):
    import glue_digits_check

    chapter = f"The share is {{glue:text}}`x{':' + spec if spec else ''}`.\n"
    found = glue_digits_check.problems(chapter, {"x": value, "x__digits": str(digits)})
    assert bool(found) == bad, found
    assert glue_digits_check.problems(chapter, {"x": value}) == []  # not rounded: every digit is real


def test_glue_records_the_digits_it_kept_for_the_check(monkeypatch):
    import types

    from attnbook.notebook import glue

    records = {}
    fake = types.SimpleNamespace(glue=lambda name, value, display: records.update({name: value}))
    monkeypatch.setitem(sys.modules, "myst_nb", fake)
    glue("share", 0.2549, digits=2)
    glue("count", 7)
    # the name the tools read (tangle.DIGITS_SUFFIX) is the one glue records
    assert records == {"share": 0.25, "share" + tangler.DIGITS_SUFFIX: 2, "count": 7}


def test_a_chapter_can_ask_colab_for_more_packages(book_copy):
    tangle_extra_chapter(book_copy, "  module: extra\n  colab_install: [some-package==1.0]\n",
                         "Extra", {"export": "A = 1"})
    setup = json.loads((book_copy / "notebooks" / "99-extra.ipynb").read_text())["cells"][0]
    assert "@{REF}\", 'some-package==1.0']" in "".join(setup["source"])


def test_setup_cell_runs_and_reports_what_it_did():
    chapter = tangler.read_chapters()[0]
    printed = subprocess.run([sys.executable, "-c", tangler.setup_cell_source(chapter)],
                             capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"attnbook \S+ \(not on Colab, nothing installed\); GPU: .+\n", printed)


def test_colab_check_installs_from_this_clone_under_a_stand_in_colab(tmp_path):
    import colab_check

    nb = nbformat.read(ROOT / "notebooks" / "01-queries-keys-values.ipynb", as_version=4)
    setup = colab_check.pointed_at_this_clone(nb, "abc1234").cells[0].source
    assert f"git+file://{ROOT}@{{REF}}" in setup and "github.com" not in setup
    assert 'REF = "abc1234"' in setup
    folder = colab_check.stand_in(tmp_path)
    found = subprocess.run(
        [sys.executable, "-c", "import sys; print('google.colab' in sys.modules)"],
        env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert found.stdout.strip() == "True"


def test_colab_url():
    url = colab_url("https://github.com/someone/attnbook/", "dev", "01-queries-keys-values")
    assert url == (
        "https://colab.research.google.com/github/someone/attnbook/blob/dev/"
        "notebooks/01-queries-keys-values.ipynb"
    )


def test_verified_cache_refuses_a_notebook_that_does_not_match(book_copy):
    notebook = book_copy / "notebooks" / "01-queries-keys-values.ipynb"
    data = json.loads(notebook.read_text())
    code_cells = [c for c in data["cells"] if c["cell_type"] == "code"]
    code_cells[3]["source"] = ["print('not what the chapter says')"]
    notebook.write_text(json.dumps(data))
    result = subprocess.run(
        [sys.executable, str(book_copy / "tools" / "verified_cache.py"), str(book_copy / "cache")],
        capture_output=True, text=True, cwd=book_copy,
    )
    assert result.returncode != 0
    assert "does not match chapters/01-queries-keys-values.md" in result.stderr


def tangle_extra_chapter(root: Path, front_matter: str, title: str, cells: dict) -> dict:
    """Tangle the book with one more chapter, whose code cells are {tag: source}; the sources
    of the modules it writes, by module name."""
    code = "".join(f"```{{code-cell}} ipython3\n:tags: [{tag}]\n\n{source}\n```\n\n"
                   for tag, source in cells.items())
    (root / "chapters" / "99-extra.md").write_text(
        f"---\nattnbook:\n{front_matter}---\n\n# {title}\n\n{code}")
    assert tangle(root).returncode == 0
    names = ["extra"] + [tag.split(":", 1)[1] for tag in cells if ":" in tag]
    return {name: (root / "code" / "attnbook" / f"{name}.py").read_text() for name in names}


GATHERED = "  module: extra\n  describe:\n    gathered: The helper again.\n"


def test_a_cell_can_export_to_a_second_module(book_copy):
    modules = tangle_extra_chapter(book_copy, GATHERED, "Extra", {
        "export": "def helper():\n    return 1",
        "export:gathered": "from attnbook.extra import helper as helper"})
    extra, gathered = modules["extra"], modules["gathered"]
    assert "def helper():" in extra and '__all__ = [\n    "helper",\n]' in extra
    assert "from attnbook.extra import helper as helper" in gathered and '"helper"' in gathered
    init = (book_copy / "code" / "attnbook" / "__init__.py").read_text()
    assert '"extra",\n    "gathered",' in init


def test_a_second_module_is_described_by_the_front_matter(book_copy):
    modules = tangle_extra_chapter(
        book_copy, "  module: extra\n  describe:\n    narrow: Only the narrow part.\n",
        "Extra things", {"export": "A = 1", "export:narrow": "B = 2"})
    assert '"""Extra things.\n\nBuilt and explained' in modules["extra"]
    assert '"""Only the narrow part.\n\nBuilt and explained' in modules["narrow"]


def test_a_split_chapter_continues_its_module_only_when_it_says_so(book_copy):
    masks_cell = {"export": "X = 1", "export:masks": "def extra_mask():\n    return None"}
    with pytest.raises(AssertionError):  # writing another chapter's module unasked is refused
        tangle_extra_chapter(book_copy, "  module: extra\n", "Extra", masks_cell)
    assert "module 'masks' is claimed by two chapters" in tangle(book_copy).stderr
    tangle_extra_chapter(book_copy, "  module: extra\n  continues: [masks]\n", "Extra", masks_cell)
    masks = (book_copy / "code" / "attnbook" / "masks.py").read_text()
    assert masks.startswith("# Do not edit: tools/tangle.py generates this file from "
                            "chapters/06-masks.md and chapters/99-extra.md.")
    # the owner's cells first, then the continuation's, each behind its own chapter's marker
    assert masks.index('# chapters/06-masks.md, "') < masks.index('# chapters/99-extra.md, "Extra"')
    assert '    "extra_mask",\n]' in masks
    import attnbook.masks as owned  # the owner's names are all still exported
    assert all(f'    "{name}",' in masks for name in owned.__all__)


def test_a_second_module_without_a_description_is_refused(book_copy):
    with pytest.raises(AssertionError):
        tangle_extra_chapter(book_copy, "  module: extra\n", "Extra",
                             {"export": "A = 1", "export:narrow": "B = 2"})
    assert "module 'narrow' needs a line in `describe`" in tangle(book_copy).stderr


def test_the_package_index_describes_each_module_as_its_docstring_does():
    files = tangler.package_files(tangler.read_chapters())
    init = files.pop("code/attnbook/__init__.py")
    for path, source in files.items():
        first = " ".join(source.split('"""')[1].split("\n\n")[0].split())
        listed = init.split(f"- attnbook.{Path(path).stem} (")[1].split('"""')[0].split("\n- ")[0]
        assert " ".join(listed.split()[1:]) == first, path


def test_generated_lines_lead_back_to_their_chapter_section(book_copy):
    chapter = book_copy / "chapters" / "99-extra.md"
    chapter.write_text(
        "---\nattnbook:\n  module: extra\n---\n\n# Extra\n\n"
        "```{code-cell} ipython3\n:tags: [export]\n\nimport math\n\nA = math.pi\n```\n\n"
        "## Second part\n\nText.\n\n```python\n## not a heading\n```\n\n"
        "```{code-cell} ipython3\n:tags: [export]\n\ndef f():\n    return A\n```\n")
    assert tangle(book_copy).returncode == 0
    source = (book_copy / "code" / "attnbook" / "extra.py").read_text()
    body = source.split('"""', 2)[2]
    # __all__ first, then each cell behind a marker that names its chapter and section
    assert body.startswith('\n\n__all__ = [\n    "A",\n    "f",\n]\n\n'
                           '# chapters/99-extra.md, "Extra"\nimport math\n')
    assert '\n\n\n# chapters/99-extra.md, "Second part"\ndef f():\n' in body
    files = tangler.package_files(tangler.read_chapters())
    for chapter in tangler.read_chapters():
        for module, cells in chapter.exports().items():
            text = files[f"code/attnbook/{module}.py"]
            markers = re.findall(rf'^ *# {re.escape(chapter.relpath)}, "(.*)"$', text,
                                 re.MULTILINE)  # indented: a cell that continues a class
            wanted = [cell.section or chapter.title for cell in cells]  # a continuing cell's
            assert sorted(markers) == sorted(wanted), module  # sits in its class, out of order


def test_a_prose_only_edit_keeps_the_outputs(book_copy):
    chapter = book_copy / "chapters" / "01-queries-keys-values.md"
    old, new = "In this chapter you will build the heart", "In this chapter you build the heart"
    assert old in chapter.read_text()  # a sentence of chapter 1's prose
    chapter.write_text(chapter.read_text().replace(old, new, 1))
    notebook = book_copy / "notebooks" / "01-queries-keys-values.ipynb"
    outputs_before = [c.get("outputs") for c in json.loads(notebook.read_text())["cells"]]
    assert tangle(book_copy).returncode == 0
    cells = json.loads(notebook.read_text())["cells"]
    assert [c.get("outputs") for c in cells] == outputs_before
    assert any(new in "".join(c["source"]) for c in cells)
    assert "01-queries-keys-values.ipynb" not in tangle(book_copy, "--check").stderr


def test_make_notebooks_reruns_a_chapter_that_imports_a_changed_module(book_copy):
    """Chapter 99 imports the module chapter 98 writes: a change to 98's exported cell changes
    no cell of 99, yet 99 is executed again, and only then."""
    def chapter(name, front_matter, tag, source):
        (book_copy / "chapters" / name).write_text(
            f"---\n{front_matter}---\n\n# {name}\n\n"
            f"```{{code-cell}} ipython3\n:tags: [{tag}]\n\n{source}\n```\n")

    def make_notebooks():
        done = subprocess.run(
            [sys.executable, str(book_copy / "tools" / "tangle.py"), "--execute", "99"],
            capture_output=True, text=True, cwd=book_copy, check=True,
            env=dict(os.environ, PYTHONPATH=str(book_copy / "code")))
        user = nbformat.read(book_copy / "notebooks" / "99-user.ipynb", as_version=4)
        return done.stdout, "".join(o.get("text", "") for o in user.cells[-1].outputs)

    chapter("98-extra.md", "attnbook:\n  module: extra\n", "export", "VALUE = 1")
    chapter("99-user.md", "title: user\n", "user", "from attnbook.extra import VALUE\nprint(VALUE)")
    printed, shown = make_notebooks()
    assert "executing chapters/99-user.md" in printed and shown == "1\n"
    assert "executing" not in make_notebooks()[0]  # nothing changed: nothing runs
    chapter("98-extra.md", "attnbook:\n  module: extra\n", "export", "VALUE = 2")
    assert "99-user.ipynb: ran another version of a module" in tangle(book_copy).stdout
    printed, shown = make_notebooks()
    assert "executing chapters/99-user.md (a module it runs changed)" in printed, printed
    assert shown == "2\n"


def test_a_notebook_runs_the_modules_it_imports_and_theirs():
    chapters = {c.slug[:2]: c for c in tangler.read_chapters()}
    files = tangler.package_files(list(chapters.values()))
    changed = dict(files)
    changed["code/attnbook/layers.py"] += "\nEXTRA = 1\n"
    # chapter 10 imports attnbook.gpt, which imports layers; chapter 1 imports attnbook.exercises,
    # whose cases compute their answers with layers; appendices C and D run nothing of layers
    assert "layers" in tangler.package_uses(chapters["10"], files)
    for slug, reruns in [("03", True), ("10", True), ("01", True), ("a3", False), ("a4", False)]:
        differs = tangler.package_digest(chapters[slug], files) != tangler.package_digest(
            chapters[slug], changed)
        assert differs == reruns, slug
    assert tangler.imported_modules(
        "import attnbook.layers\nfrom attnbook import masks as m, gpt\nattnbook.viz.draw()\n"
        "from attnbook.bert import BERT  # attnbook.nothing\n", set(files_stems(files))) == {
        "layers", "masks", "gpt", "viz", "bert"}


def files_stems(files: dict[str, str]) -> list[str]:
    return [Path(rel).stem for rel in files]


def test_a_new_figure_caption_keeps_the_outputs_and_code_changes_drop_them(book_copy):
    chapter = book_copy / "chapters" / "01-queries-keys-values.md"
    notebook = book_copy / "notebooks" / "01-queries-keys-values.ipynb"
    outputs_before = [c.get("outputs") for c in json.loads(notebook.read_text())["cells"]]
    old = "    caption: Figure 1.1. Attention with the shape"
    assert old in chapter.read_text()
    chapter.write_text(chapter.read_text().replace(old, old.replace("Attention", "Scaled attention")))
    assert tangle(book_copy).returncode == 0
    cells = json.loads(notebook.read_text())["cells"]
    assert [c.get("outputs") for c in cells] == outputs_before
    assert any("Scaled attention" in str(c["metadata"]) for c in cells)
    old = "Lq, Lk, d_k, d_v = 4, 6, 3, 2"
    assert old in chapter.read_text()
    chapter.write_text(chapter.read_text().replace(old, "Lq, Lk, d_k, d_v = 4, 6, 3, 3"))
    assert "outputs dropped" in tangle(book_copy).stdout
    assert not any(c.get("outputs") for c in json.loads(notebook.read_text())["cells"])


def test_text_cells_become_plain_markdown_for_colab():
    cited = {"dao2022": "Dao et al., 2022", "two2001": "One and Two, 2001"}
    text = ("An *{term}`online softmax <online softmax>`* and {term}`tiling` "
            "{cite}`dao2022, two2001` {cite:p}`two2001`.\n\n"
            "````{admonition} Solutions\n:class: dropdown\n\n1. ```python\n   x = 1\n   ```\n````\n"
            "```{admonition} Note\nPlain.\n```")
    assert tangler.plain_markdown(text, cited) == (
        "An *online softmax* and tiling (Dao et al., 2022; One and Two, 2001) (One and Two, 2001)."
        "\n\n"
        "<details>\n<summary>Solutions</summary>\n\n1. ```python\n   x = 1\n   ```\n\n"
        "</details>\n**Note**\n\nPlain.")
    with pytest.raises(ValueError, match="nobody2020.*cited but not in book/references.bib"):
        tangler.plain_markdown("{cite}`nobody2020`", cited)


def test_citations_come_from_the_bibliography():
    cited = tangler.citations()
    assert cited["vaswani2017attention"] == "Vaswani et al., 2017"
    assert cited["milakov2018online"] == "Milakov and Gimelshein, 2018"


def test_glued_values_come_from_the_notebooks_own_outputs():
    record = nbformat.v4.new_output(
        "display_data", data={"application/papermill.record/text/plain": "0.87451"},
        metadata={"scrapbook": {"name": "ratio", "mime_prefix": "application/papermill.record/"}})
    code = nbformat.v4.new_code_cell("glue('ratio', 0.87451)", outputs=[record])
    text = nbformat.v4.new_markdown_cell(
        "{glue:text}`ratio:.1%`, {glue:text}`ratio` and {glue:text}`later:.2f`")
    filled = tangler.fill_glue(nbformat.v4.new_notebook(cells=[code, text]))
    assert filled.cells[1].source == "87.5%, 0.87451 and {glue:text}`later:.2f`"


def test_committed_notebooks_show_no_myst_markup():
    markup = re.compile(r"\{(term|cite(:\w+)?|glue:text|admonition)\}")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                assert not markup.search("".join(cell["source"])), path


def test_a_module_with_an_entry_point_runs_it_only_as_a_script(book_copy):
    modules = tangle_extra_chapter(
        book_copy, "  module: extra\n  main:\n    extra: main\n", "Extra",
        {"export": "def main():\n    print('ran main')"})
    assert modules["extra"].endswith(
        'if __name__ == "__main__":  # python -m attnbook.extra\n    main()\n')
    code = book_copy / "code"
    run = subprocess.run([sys.executable, "-m", "attnbook.extra"], cwd=code, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(code)})
    assert run.stdout == "ran main\n", run.stderr
    imported = subprocess.run([sys.executable, "-c", "import attnbook.extra"], cwd=code,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(code)})
    assert imported.returncode == 0 and imported.stdout == ""


def test_solutions_are_hidden_in_jupyter_and_on_colab_as_on_the_site():
    # The site collapses a cell tagged hide-input; Jupyter and Colab ignore that tag, so the
    # notebook must carry what each of them reads, or the solution sits under its exercise.
    for chapter in tangler.read_chapters():
        nb, solutions = tangler.notebook_source(chapter), 0
        for cell in nb.cells:
            if cell.cell_type != "code" or "hide-input" not in cell.metadata.get("tags", []):
                continue
            assert cell.metadata["jupyter"] == {"source_hidden": True}, chapter.relpath
            assert cell.metadata["cellView"] == "form", chapter.relpath
            title = cell.source.splitlines()[0]
            assert title.startswith("# @title "), (chapter.relpath, title)
            solutions += title.startswith("# @title Solutions")
        # the chapter's own code, as tools/verified_cache.py reads it back
        ours = [c.source for c in chapter.notebook.cells if c.cell_type == "code"]
        theirs = [tangler.chapter_source(c) for c in nb.cells[1:] if c.cell_type == "code"]
        assert ours == theirs, chapter.relpath
        if "\n## Exercises\n" in chapter.path.read_text():  # a page with exercises has solutions
            assert solutions >= 1, chapter.relpath


def test_a_module_exports_what_it_defines_and_what_it_explicitly_re_exports():
    source = ("from attnbook.layers import causal_mask as causal_mask\n"
              "from attnbook.checks import check_int\n"
              "def padding_mask(): ...\n"
              "def _helper(): ...\n"
              "LIMIT = 3\n")
    assert tangler.public_names(source) == ["causal_mask", "padding_mask", "LIMIT"]
    # a module that only imports names exports none of them: the special case for a module that
    # gathered others' names (the old attnbook.models) is gone with that module
    assert tangler.public_names("from attnbook.layers import attend, LayerCache\n") == []
    overloaded = ("@overload\ndef f(x: int) -> int: ...\n@overload\ndef f(x: str) -> str: ...\n"
                  "def f(x):\n    return x\n")
    assert tangler.public_names(overloaded) == ["f"]  # not once per @overload stub


def _figure_cells(notebook: Path):
    """(metadata of the cell's figure, or None) for each code cell that draws an image."""
    nb = nbformat.read(notebook, as_version=4)
    return [cell.metadata.get("mystnb", {}) for cell in nb.cells if cell.cell_type == "code"
            and any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))]


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")),
                         ids=lambda p: p.stem)
def test_every_image_is_a_numbered_captioned_figure_with_alt_text(notebook):
    label = notebook.stem[:2].lstrip("0")
    if label.startswith("a"):  # appendices are lettered: a1 is A, a2 is B, ...
        label = "ABCDEFGH"[int(label[1:]) - 1]
    for number, figure in enumerate(_figure_cells(notebook), start=1):
        caption = figure.get("figure", {}).get("caption", "")
        assert caption.startswith(f"Figure {label}.{number}. "), (notebook.name, number, caption)
        assert figure["figure"].get("name", "").startswith("fig-"), (notebook.name, number)
        assert len(figure.get("image", {}).get("alt", "")) > 40, (notebook.name, number)


def test_figure_names_are_unique_in_the_book():
    names = [figure["figure"]["name"] for notebook in sorted((ROOT / "notebooks").glob("*.ipynb"))
             for figure in _figure_cells(notebook) if "figure" in figure]
    assert len(names) == len(set(names)) > 30


# --- a class built over several cells (`# continues Name`) -----------------------------------

CLASS_OVER_CELLS = '''---
attnbook:
  module: extra
---

# Extra

```{code-cell} ipython3
:tags: [export]

class Counter:
    """Numbers counted so far."""

    def __init__(self):
        self.counts = []
```

## Adding

```{code-cell} ipython3
:tags: [export]

# continues Counter
def add(self, x):
    """Count `x`; the counter again."""
    self.counts.append(x)
    return self


# the sum of what was counted
@property
def total(self):
    return sum(self.counts)


Counter.add = add
Counter.total = total
```

```{code-cell} ipython3
c = Counter().add(2).add(3)
assert c.total == 5
```

```{code-cell} ipython3
:tags: [export]

def make():
    return Counter()
```

## Several at once

```{code-cell} ipython3
:tags: [export]

# continues Counter
@classmethod
def of(cls, *xs):
    counter = cls()
    for x in xs:
        counter.add(x)
    return counter


Counter.of = of
```
'''


def _chapter_from_text(text: str):
    import jupytext

    return tangler.Chapter(ROOT / "chapters" / "99-extra.md", jupytext.reads(text, fmt="md:myst"))


def _import_module(source: str, tmp_path: Path, name: str = "extra"):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"generated_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_class_built_over_several_cells_is_one_class_in_its_module(tmp_path):
    """Before `# continues`, the methods stayed top-level functions of the module (in its
    __all__, qualnames `add`, `total`), attached by lines the reader of the module had to find."""
    chapter = _chapter_from_text(CLASS_OVER_CELLS)
    source = tangler.package_files([chapter])["code/attnbook/extra.py"]
    module = _import_module(source, tmp_path)
    assert module.__all__ == ["Counter", "make"]
    counter = module.Counter.of(1, 2).add(4)
    assert counter.total == 7 and isinstance(module.make(), module.Counter)
    for method in ("add", "of"):
        assert getattr(module.Counter, method).__qualname__ == f"Counter.{method}"
    assert module.Counter.total.fget.__qualname__ == "Counter.total"
    assert "Counter.add = add" not in source and "\ndef add" not in source
    # the methods close the class body, each cell's behind a comment naming its section
    body = source.split("class Counter:", 1)[1].split("\n\n\n# chapters/", 1)[0]
    assert '\n    # chapters/99-extra.md, "Adding"\n    def add(self, x):\n' in body
    assert "\n    # the sum of what was counted\n    @property\n    def total(self):\n" in body
    assert '\n    # chapters/99-extra.md, "Several at once"\n    @classmethod\n' in body
    assert "\n\n\n" not in body and not any(line.isspace() for line in body.splitlines())
    # the chapter's own cells, run in order as its notebook runs them, give the same class
    namespace = {}
    for cell in chapter.notebook.cells:
        if cell.cell_type == "code":
            exec(cell.source, namespace)
    assert namespace["Counter"].of(1, 2).add(4).total == 7


@pytest.mark.parametrize("cell,problem", [
    ("# continues Missing\ndef f(self):\n    pass\n\n\nMissing.f = f",
     "no earlier exported cell of module 'extra' defines a class Missing"),
    ("# continues Counter\ndef f(self):\n    pass\n\n\ndef g(self):\n    pass\n\n\nCounter.f = f",
     r"each function must be attached once, `Counter.f = f`: defined \['f', 'g'\], attached \['f'\]"),
    ("# continues Counter\ndef f(self):\n    pass\n\n\nCounter.g = f",
     r"line 6 is neither a method \(def\) nor its attaching line"),
    ("# continues Counter\nLIMIT = 3", "line 2 is neither a method"),
    ("# continues Counter\ndef __init__(self):\n    super().__init__()\n\n\n"
     "Counter.__init__ = __init__",
     r"__init__ calls super\(\) without arguments, .* write super\(Counter, self\)"),
    ('# continues Counter\ndef f(self):\n    """Doc\n    string."""\n    return """a\nb"""\n\n\n'
     "Counter.f = f", "line 5 starts a string over several lines"),
    ('# continues Counter\ndef f(self):\n    return f"""{self}\nb"""\n\n\nCounter.f = f',
     "line 3 starts a string over several lines"),
])
def test_a_continuing_cell_that_the_module_could_not_hold_as_written_is_refused(cell, problem):
    text = CLASS_OVER_CELLS.split("## Adding")[0] + f"```{{code-cell}} ipython3\n:tags: [export]\n\n{cell}\n```\n"
    with pytest.raises(ValueError, match=r"chapters/99-extra.md, cell \d+ \(# continues \w+\): "
                                         + problem):
        tangler.package_files([_chapter_from_text(text)])


def test_a_docstring_over_several_lines_reads_as_in_the_chapter(tmp_path):
    cell = ('# continues Counter\ndef f(self):\n    """First line.\n\n    More."""\n'
            "    return 1\n\n\nCounter.f = f")
    text = CLASS_OVER_CELLS.split("## Adding")[0] + f"```{{code-cell}} ipython3\n:tags: [export]\n\n{cell}\n```\n"
    source = tangler.package_files([_chapter_from_text(text)])["code/attnbook/extra.py"]
    module = _import_module(source, tmp_path)
    import inspect

    assert inspect.getdoc(module.Counter.f) == "First line.\n\nMore." and module.Counter().f() == 1


def _chapter_of_cells(*cells: str):
    """A synthetic chapter of module `extra` whose code cells, all exported, are `cells`."""
    text = "---\nattnbook:\n  module: extra\n---\n\n# Extra\n\n## Cells\n" + "".join(
        f"\n```{{code-cell}} ipython3\n:tags: [export]\n\n{cell}\n```\n" for cell in cells)
    return _chapter_from_text(text)


def _run_as_chapter(chapter) -> dict:
    namespace = {}
    for cell in chapter.notebook.cells:
        if cell.cell_type == "code":
            exec(cell.source, namespace)
    return namespace


COUNTER = "class Counter:\n    count = 1"


# Each of these tangled, before, into a module that behaves otherwise than the chapter as run
# (shown in the comment): the tangler refuses them, naming the chapter and the cell.
@pytest.mark.parametrize("cells,problem", [
    # a __name is mangled in a class body only: the chapter raises AttributeError, the module not
    ((COUNTER + "\n\n    def __init__(self):\n        self.__n = 1",
      "# continues Counter\ndef peek(self):\n    return self.__n\n\n\nCounter.peek = peek"),
     r"line 3 uses __n, which Python renames to _Counter__n in a class body only"),
    # a method calling its sibling by bare name: the module raises NameError
    ((COUNTER, "# continues Counter\ndef _half(self, x):\n    return x / 2\n\n\n"
      "def g(self):\n    return _half(self, 4)\n\n\nCounter._half = _half\nCounter.g = g"),
     r"_half is also used by its bare name in module 'extra'"),
    # __init_subclass__ is implicitly a classmethod in a body only
    ((COUNTER, "# continues Counter\ndef __init_subclass__(cls):\n    pass\n\n\n"
      "Counter.__init_subclass__ = __init_subclass__"),
     r"__init_subclass__: of the names starting with '__', only __call__, .* may be defined"),
    # a dataclass reads __post_init__ when it is made: the module's runs, the chapter's not
    (("from dataclasses import dataclass\n\n\n@dataclass\nclass Counter:\n    count: int = 0",
      "# continues Counter\ndef __post_init__(self):\n    self.count = 2\n\n\n"
      "Counter.__post_init__ = __post_init__"),
     r"class Counter \(chapters/99-extra.md, cell \d+\) is decorated, has a metaclass or is an ABC"),
    # implementing an abstract method later leaves the chapter's class abstract
    (("from abc import ABC, abstractmethod\n\n\nclass Shape(ABC):\n    @abstractmethod\n"
      "    def area(self): ...", "class Square(Shape):\n    side = 1",
      "# continues Square\ndef area(self):\n    return 1.0\n\n\nSquare.area = area"),
     r"area is an abstract method of the module"),
    # cached_property needs __set_name__, which only a class body calls
    (("import functools", COUNTER, "# continues Counter\n@functools.cached_property\n"
      "def big(self):\n    return 42\n\n\nCounter.big = big"),
     r"big is decorated with @functools.cached_property; a continuing cell allows only"),
    # an annotation naming the class itself: unbound in the class body, the module fails
    ((COUNTER, "# continues Counter\ndef clone(self) -> Counter:\n    return self\n\n\n"
      "Counter.clone = clone"),
     r"clone's decorators, defaults or annotations name Counter, which its class body cannot"),
    # a default naming a global bound after the class: the module fails to import
    ((COUNTER, "LIMIT = 7", "# continues Counter\ndef f(self, n=LIMIT):\n    return n\n\n\n"
      "Counter.f = f"),
     r"f's decorators, defaults or annotations name LIMIT, which a cell after the class binds"),
    # an annotation naming a class attribute: the class body's `count`, the chapter's global
    (("count = int", COUNTER, "# continues Counter\ndef f(self) -> count:\n    return 1\n\n\n"
      "Counter.f = f"),
     r"f's decorators, defaults or annotations name count, which the class's body binds"),
    # a one-line class: before, a raw IndentationError from the generated source
    (("class Counter: pass", "# continues Counter\ndef f(self):\n    return 1\n\n\nCounter.f = f"),
     r"class Counter \(chapters/99-extra.md, cell \d+\) has its body on the line of `class`"),
    # a method named like a module-level function: the chapter's later cells call the method
    (("def size(x):\n    return len(x)\n\n\n" + COUNTER,
      "# continues Counter\ndef size(self):\n    return 99\n\n\nCounter.size = size",
      "def total(xs):\n    return size(xs)"),
     r"size is also a module-level name in module 'extra'"),
    # attaching before the def: the chapter attaches whatever the name meant before
    ((COUNTER, "# continues Counter\nCounter.f = f\n\n\ndef f(self):\n    return 'new'"),
     r"line 2 attaches f before the cell defines it"),
    # a multi-line string on a docstring's line was exempted with the docstring, and indented
    ((COUNTER, "# continues Counter\ndef f(self):\n    \"\"\"Doc.\"\"\"; s = '''a\nb'''\n"
      "    return s\n\n\nCounter.f = f"),
     r"line 3 starts a string over several lines"),
    # the class's name rebound before the continuing cell: the chapter adds to pathlib.Path
    (("class Path:\n    count = 1", "from pathlib import Path",
      "# continues Path\ndef f(self):\n    return 'mine'\n\n\nPath.f = f"),
     r"Path is rebound after its class \(chapters/99-extra.md, cell \d+, line 1\)"),
    # a cell between reads the class when it runs: the chapter's class has no f yet
    ((COUNTER, "HAS_F = hasattr(Counter, 'f')",
      "# continues Counter\ndef f(self):\n    return 1\n\n\nCounter.f = f"),
     r"chapters/99-extra.md, cell \d+, line 1 uses Counter when it runs, before this cell adds"),
    # __class__ exists in a class body only
    ((COUNTER, "# continues Counter\ndef f(self):\n    return __class__\n\n\nCounter.f = f"),
     r"f uses __class__, which only a class body defines"),
])
def test_a_continuing_cell_that_would_run_otherwise_in_the_module_is_refused(cells, problem):
    with pytest.raises(ValueError, match=r"chapters/99-extra.md, cell \d+ \(# continues \w+\): "
                                         + problem):
        tangler.package_files([_chapter_of_cells(*cells)])


def test_a_continued_methods_docstring_is_the_chapters(tmp_path):
    """Before, blank runs inside the docstring collapsed, so that it read otherwise than the
    chapter's; then its inner lines kept the cell's indentation, four spaces short of the
    method's body in the module."""
    import inspect

    cell = ('# continues Counter\ndef f(self):\n    """One.\n\n\n    Two.\n    """\n'
            "    return 1\n\n\nCounter.f = f")
    chapter = _chapter_of_cells(COUNTER, cell)
    source = tangler.package_files([chapter])["code/attnbook/extra.py"]
    module = _import_module(source, tmp_path)
    chapters = _run_as_chapter(chapter)["Counter"].f
    assert inspect.getdoc(module.Counter.f) == inspect.getdoc(chapters) == "One.\n\n\nTwo."
    assert '        """One.\n\n\n        Two.\n        """\n        return 1\n' in source
    assert module.Counter().f() == 1


def test_what_a_continuing_cell_may_hold_runs_alike_in_chapter_and_module(tmp_path):
    """The allowed decorators and special methods give the same class both ways."""
    cells = ("import torch", COUNTER + "\n\n    def __init__(self):\n        self.n = 0",
             "# continues Counter\ndef __init__(self, n=2):\n    super(Counter, self).__init__()\n"
             "    self.n = n\n\n\ndef __repr__(self):\n    return f'Counter({self.n})'\n\n\n"
             "@staticmethod\ndef twice(x):\n    return 2 * x\n\n\n@torch.no_grad()\n"
             "def grad_free(self):\n    return torch.is_grad_enabled()\n\n\n"
             "Counter.__init__ = __init__\nCounter.__repr__ = __repr__\n"
             "Counter.twice = twice\nCounter.grad_free = grad_free")
    chapter = _chapter_of_cells(*cells)
    module = _import_module(tangler.package_files([chapter])["code/attnbook/extra.py"], tmp_path)
    for cls in (module.Counter, _run_as_chapter(chapter)["Counter"]):
        assert (repr(cls()), cls.twice(3), cls().grad_free(), cls.count) == ("Counter(2)", 6,
                                                                             False, 1)


DATACLASS_OVER_CELLS = '''---
attnbook:
  module: extra
---

# Extra

```{code-cell} ipython3
:tags: [export]

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """Two sizes."""

    width: int = 2
    depth: int = 1
```

## A preset

```{code-cell} ipython3
:tags: [export]

# continues Sizes
@classmethod
def wide(cls, **fields):
    return cls(**{"width": 8, **fields})


Sizes.wide = wide
```
'''


def test_a_dataclass_takes_methods_from_later_cells_but_no_dunder(tmp_path):
    """@dataclass reads only the fields and the dunder methods when it makes the class: a
    classmethod added by a later cell behaves the same in the class body (chapter 19 adds
    GPTConfig.llama so); a __post_init__ is still refused (test above)."""
    chapter = _chapter_from_text(DATACLASS_OVER_CELLS)
    source = tangler.package_files([chapter])["code/attnbook/extra.py"]
    module = _import_module(source, tmp_path)
    assert module.Sizes.wide(depth=3) == module.Sizes(8, 3) and "Sizes.wide = wide" not in source
    assert module.Sizes.wide.__qualname__ == "Sizes.wide"
    namespace = _run_as_chapter(chapter)
    assert namespace["Sizes"].wide(depth=3) == namespace["Sizes"](8, 3)
