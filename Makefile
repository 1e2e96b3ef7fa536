# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch lies on this machine's disk; installing it first keeps
# pip from resolving the project's `torch` range to a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC='torch==2.13.0 --index-url ...' or preinstall.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Braced, so a failed pip fails the recipe (pipefail) while grep finding nothing does not.
QUIET_PIP := { grep -v '^WARNING: Location' || true; }

.PHONY: install demo test lint clean mutation

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC) 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -e '.[test]' 2>&1 | $(QUIET_PIP)
	# Notebooks run on kernel "python3"; this one runs the venv's interpreter (absolute path).
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c 'import lab, torch; print("installed lab with torch", torch.__version__)'
	# Every CPU kernel compiled once into numba's cache (about a minute on 2 cores), so
	# no training run pays it; runs are new processes that would each compile.
	$(PY) -m numba_kernels.warm
	touch $(STAMP)

install: $(STAMP)

# The demo protocols on a local Dask cluster, each followed by its report notebook
# rendered to HTML under reports/ (the paths are printed): every learning rule x 2
# seeds at demo size (bp among them), then one quick protocol per other system:
# MT-1 (kp_traffic, both traffic signs), the EP transformer with its backprop twin, CfC
# with the auxiliary path, CfC on daily markets. Each full protocol is one `lab sweep` away (see README), the
# backprop baseline at its full recipe too (`lab sweep protocols/demo.yaml`).
DEMO_PROTOCOLS := rules-mnist1d-demo mt1-quick ep-twin-quick cfc-aux-quick cfc-markets-quick
demo: $(STAMP)
	for p in $(DEMO_PROTOCOLS); do \
	  $(VENV)/bin/lab sweep protocols/$$p.yaml && \
	  $(VENV)/bin/lab runs protocols/$$p.yaml && \
	  $(VENV)/bin/lab report protocols/$$p.yaml || exit 1; \
	done

lint: $(STAMP)
	$(PY) -m ruff check .

# Two pytest-xdist workers, each on one thread (tests/conftest.py: two workers on
# torch's default of a thread per core made small-op tests 5 - 10x slower), and
# work stealing so the long end-to-end tests do not finish last on one worker. The float64
# kernels the tests use are compiled first, once, rather than by both workers.
# The import contracts first (pyproject.toml [tool.importlinter]; well under a second).
test: $(STAMP) lint
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m numba_kernels.warm --float64
	$(PY) -m pytest -q -n 2 --dist worksteal

# Mutation testing of the rules, diagnostics, trainers and kernels (not part of
# `make test`: about an hour on 2 cores). Prints the score and the survivors.
mutation: $(STAMP)
	$(PY) -m pip install -q -e '.[mutation]' 2>&1 | $(QUIET_PIP)
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2 || true
	$(VENV)/bin/mutmut results
	$(VENV)/bin/mutmut export-cicd-stats
	$(PY) benchmarks/mutation_score.py

clean:
	rm -rf $(VENV) runs reports .pytest_cache mutants
