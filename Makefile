# meshcache: `make demo` and `make test` set everything up from nothing (Debian 12, root).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: setup filter test test-filter test-python lint demo bench clean

setup:
	@scripts/setup.sh

filter: setup
	@filter/build.sh release

test-filter: setup
	@filter/build.sh test

lint: setup
	$(VENV)/bin/ruff check .

test-python: setup filter
	$(PY) -m pytest $(PYTEST_ARGS)

test: test-filter lint test-python

demo: setup filter
	$(PY) -m meshcache.ctl.cli demo

bench: setup filter
	$(PY) -m bench.run

clean:
	rm -rf filter/target filter/dist
