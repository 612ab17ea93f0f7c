# The two set-up commands: `make run` (the main job) and `make test` (the whole suite).
# Both create and reuse .venv; pip installs from constraints.txt so torch stays the CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_MODEL := .cache/demo-model
PROMPT ?= def fibonacci(n):

.PHONY: run test lint proto clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

$(DEMO_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/tandem model init --preset tiny --out $(DEMO_MODEL)

run: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/tandem generate --model $(DEMO_MODEL) --prompt '$(PROMPT)' --max-tokens 32

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV) .cache
