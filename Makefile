# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create or reuse .venv with the pinned, tested set (requirements.txt) plus this project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check tsp_ext tests recipes
	$(VENV)/bin/ruff format --check tsp_ext tests recipes

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 recipes/tsp_demo.py
