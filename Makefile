# Two commands matter: `make demo` and `make test`. Both create the virtual
# environment on first use. CPU torch is pinned here (the package itself only
# asks for torch>=2.11 so that GPU machines keep their own build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.kiln-installed

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The demo model (SmolLM2-135M-Instruct) is fetched once into kiln's cache; the
# first run compiles it at -O2 (a few minutes on 2 cores), later runs load the
# compiled pieces.
demo: setup
	$(VENV)/bin/kiln fetch-demo
	$(VENV)/bin/kiln generate --chat --prompt "What is the capital of France?"

test: setup
	$(PY) -m pytest -q tests

# The unit layer: scheduler, block pool, sampler, dispatcher, configs, output
# processor, checkpoint readers, engine core with a stub model, code shape.
test-fast: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) -m bench.decode
	$(PY) -m bench.compile_scaling
	$(PY) -m bench.startup
	$(PY) -m bench.compile_sizes
	$(PY) -m bench.cpu_kernels
	$(PY) -m bench.sampler

clean:
	rm -rf $(VENV) build *.egg-info
