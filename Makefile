# The two set-up commands: `make run` (the main job) and `make test` (the whole suite).
# Both create and reuse .venv; pip installs from constraints.txt so torch stays the CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

.PHONY: run test lint proto clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/tandem serve --config examples/local.yaml --port 0 --prompt '$(PROMPT)' --max-tokens 48

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV)
