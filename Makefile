# meshcache: `make demo` and `make test` set everything up from nothing (Debian 12, root).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Three workers on two cores: the suite waits on real processes more than it computes. A module goes
# to one worker at a time, costliest first (tests/conftest.py SLOW_FIRST), so its module-scoped
# stacks and meshes start once and no long module ends the run alone.
PYTEST_ARGS ?= -n 3 --dist loadscope --no-loadscope-reorder

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

# The same three as test-filter, lint and test-python, with the cargo tests in the background (scripts/test.sh).
test: setup filter
	@PYTEST_ARGS="$(PYTEST_ARGS)" scripts/test.sh

demo: setup filter
	$(PY) -m meshcache.ctl.cli demo

# The engine, control-plane and native module images (scripts/images.sh: buildah, podman or docker; base pinned by digest).
images: setup
	@scripts/images.sh

bench: setup filter
	$(PY) -m bench.run

clean:
	rm -rf filter/target filter/native/target filter/dist dist
