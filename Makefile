# payhook: `make run` starts the whole stack, `make test` runs lint and every test.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: run test install services browser lint docs format unit integration e2e bench clean

# `payhook up` finds the local PostgreSQL and Redis, or starts embedded ones.
run: install
	$(BIN)/payhook up

# Four workers on two cores: most tests wait on servers and processes. Tests
# go to whichever worker is free; a module that starts one stack of processes
# for all its tests marks them `xdist_group`, so they stay on one worker.
test: install services browser lint docs
	$(BIN)/pytest -n 4 --dist loadgroup

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

services:
	scripts/services.sh

# Chromium, chromedriver and promtool for the dashboard and alert-rule tests;
# kubectl (its kustomize) for the Kubernetes manifests' offline validation.
browser:
	scripts/browser.sh
	scripts/kubectl.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The manual in docs/; strict, so a broken link or a page left out of the nav fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

unit: install
	$(BIN)/pytest tests/unit

integration: install services
	$(BIN)/pytest tests/integration

e2e: install services
	$(BIN)/pytest tests/e2e

bench: install services
	$(BIN)/python -m bench.consumer
	$(BIN)/python -m bench.ingress
	$(BIN)/python -m bench.outbox
	$(BIN)/python -m bench.e2e

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
