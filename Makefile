# The two commands of the README and docs/getting-started.md. Each creates the virtual environment when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: serve test bench lint docs docs-serve

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, from its pinned release, so no other package pulls a different (CUDA) build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/loraplex serve

test: $(STAMP)
	$(VENV)/bin/loraplex models pull
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) scripts/bench_engine.py --json

lint: $(STAMP)
	$(VENV)/bin/ruff check app engine kernels scripts tests docs/hooks

# The documentation site (docs/, mkdocs.yml): built into site/ with broken links and anchors as errors.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001
