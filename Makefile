# meshcache: `make demo` and `make test` set everything up from nothing (Debian 12, root).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Three workers on two cores: most tests wait on real processes (Envoy, the engine, istiod), so
# a third worker fills the idle time (measured: pytest 257 s with -n 3, 335 s with -n 2).
PYTEST_ARGS ?= -n 3

.PHONY: setup filter test test-filter test-python lint demo bench clean images

setup:
	@scripts/setup.sh

filter: setup
	@filter/build.sh release
	@filter/build.sh native

test-filter: setup
	@filter/build.sh test
	@filter/build.sh native-test

lint: setup
	$(VENV)/bin/ruff check .

test-python: setup filter
	$(PY) -m pytest $(PYTEST_ARGS)

test: test-filter lint test-python

demo: setup filter
	$(PY) -m meshcache.ctl.cli demo

# The engine and control-plane images (scripts/images.sh: buildah, podman or docker; base pinned by digest).
images: setup
	@scripts/images.sh

bench: setup filter
	$(PY) -m bench.run

clean:
	rm -rf filter/target filter/native/target filter/dist dist
