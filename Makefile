# attnbook: `make book` builds the site executing every chapter; `make test` runs every check.
# Both create .venv on first use.

PYTHON_FOR_VENV ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BOOK_FLAGS := -W -n --keep-going
export PYTHONHASHSEED := 0

.PHONY: book test tangle notebooks check-sync lint pytest site-verified venv clean
VERIFIED := _build/verified

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON_FOR_VENV) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

## tangle: write code/attnbook/ and the notebooks' sources from chapters/
tangle: $(STAMP)
	$(PY) tools/tangle.py

## notebooks: tangle, then execute the notebooks whose chapter changed (FORCE=1: all of them)
notebooks: $(STAMP)
	$(PY) tools/tangle.py --execute $(if $(FORCE),--force)

## book: build the site into _build/html, executing every chapter (cached between builds)
book: $(STAMP)
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS)
	@echo "The book is in _build/html/index.html"

## check-sync: code/ and notebooks/ must be what the chapters produce
check-sync: $(STAMP)
	$(PY) tools/tangle.py --check

lint: $(STAMP)
	$(VENV)/bin/ruff check code tools tests book/_ext notebooks conftest.py

## pytest: package tests, then every notebook re-executed and compared by nbval
pytest: $(STAMP)
	$(VENV)/bin/pytest tests notebooks --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg \
		--durations=5 -p no:cacheprovider

## site-verified: build the site with -W from the notebooks pytest just verified, executing nothing
## again (see tools/verified_cache.py); the HTML is in _build/verified/_build/html
site-verified: $(STAMP)
	rm -rf $(VERIFIED)
	$(PY) tools/verified_cache.py $(VERIFIED)/_build/.jupyter_cache --times _build/notebook-times.json
	$(VENV)/bin/jupyter-book build . --path-output $(VERIFIED) $(BOOK_FLAGS)

## test: every check, timed: sync, lint, tests and every chapter (nbval), then the site
test: $(STAMP)
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory check-sync lint pytest site-verified && \
	echo "make test: all checks passed in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf _build
