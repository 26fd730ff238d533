#!/usr/bin/env bash
# `make test` after setup and the filter builds: the cargo tests of the cache core and both hosts
# (filter/build.sh test, native-test) run in the background while ruff and pytest run; on two
# cores their compile fills the time pytest's workers spend waiting on real processes. Their
# output follows pytest's; any of the three failing fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
(filter/build.sh test && filter/build.sh native-test) >"$log" 2>&1 &
cargo=$!
.venv/bin/ruff check .
ruff_rc=$?
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
.venv/bin/python -m pytest ${PYTEST_ARGS:-}
pytest_rc=$?
wait "$cargo"
cargo_rc=$?
echo "== cargo test (filter/build.sh test, native-test): exit status $cargo_rc"
cat "$log"
for rc in $ruff_rc $pytest_rc $cargo_rc; do
  [ "$rc" -eq 0 ] || exit "$rc"
done
