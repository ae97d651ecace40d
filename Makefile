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

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)  # everything that runs in one process (no spawned workers, no Prefect server)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) retexo-store .prefect
