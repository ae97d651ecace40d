# The README's two commands: `make demo` and `make test`. Both create the project's own
# virtual environment (.venv) with every pinned dependency first; nothing else is needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/retexo run configs/cora_gcn.yaml

# Tests run in parallel workers (pytest-xdist): most of them wait on the processes they start
# (workers, Prefect servers, torchrun), so more workers than cores pay off; the tests of a module
# that shares one expensive server stay on one worker (--dist loadgroup, xdist_group marks).
TEST_WORKERS ?= 4

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

test-fast: $(STAMP)  # everything that runs in one process (no spawned workers, no Prefect server)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) retexo-store .prefect
