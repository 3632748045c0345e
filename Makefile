# The two commands of the README and docs/getting-started.md. Each creates the virtual environment when it is
# missing and installs exactly the versions in requirements.lock (the set the tests passed with).
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
LOCK := requirements.lock
STAMP := $(VENV)/.installed-stamp
# Where `make lock` finds torch's CPU build: the local wheel folder pip is configured with (PIP_FIND_LINKS),
# else PyTorch's CPU index. PyPI's own torch wheels for Linux are the CUDA build.
TORCH_CPU_SOURCE ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)

.PHONY: serve test bench lint lock docs docs-serve chromium

$(STAMP): $(LOCK) pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# uv (the installer, itself in the lock) and torch's CPU build come first through pip, which knows where
	# the CPU build lies; uv then makes the environment exactly the lock, resolving nothing.
	$(PY) -m pip install --quiet "$$(grep -m1 '^uv==' $(LOCK))" "$$(grep -m1 '^torch==' $(LOCK))"
	$(UV) pip sync --quiet --python $(PY) $(LOCK)
	$(UV) pip install --quiet --python $(PY) --no-deps -e .
	# The native CPU kernels, built now so the server's and the tests' first start find them built. Without a
	# C++ compiler, or when the build fails, set-up goes on (the reason is printed): the engine runs torch's kernels.
	$(VENV)/bin/loraplex kernels build || echo "make: set-up goes on without the native CPU kernels (reason above)" >&2
	touch $(STAMP)

# Refreshes requirements.lock to the newest releases that pyproject.toml allows (extras dev and ray included).
# Upgrade on purpose: run `make lock`, then `make test`, and commit the lock with the tests passing.
lock: $(STAMP)
	$(UV) pip compile pyproject.toml --extra dev --extra ray --upgrade --python-version 3.11 \
		$(TORCH_CPU_SOURCE) --quiet --no-header --no-emit-find-links --output-file $(LOCK)

serve: $(STAMP)
	$(VENV)/bin/loraplex serve

# The console's browser tests drive Debian's Chromium through Playwright (no browser download at run time).
chromium:
	@command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) || \
		{ echo "make: the console's browser tests need Chromium: install the chromium package (as root: apt-get install -y chromium)" >&2; exit 1; }

test: $(STAMP) chromium
	$(VENV)/bin/ruff check app engine loraplex_kernels scripts tests docs/hooks
	$(VENV)/bin/loraplex models pull
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m scripts.benchmarks.engine.bench_engine --json

lint: $(STAMP)
	$(VENV)/bin/ruff check app engine loraplex_kernels scripts tests docs/hooks

# The documentation site (docs/, mkdocs.yml): built into site/ with broken links and anchors as errors.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001
