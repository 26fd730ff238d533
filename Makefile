# meshcache: `make demo` and `make test` set everything up from nothing (Debian 12, root).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Two workers on two cores. Three are faster (pytest 257-295 s instead of 335-360 s: the suite waits on
# real processes more than it computes) but two of four fresh-clone runs then hit timing races.
PYTEST_ARGS ?= -n 2

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
