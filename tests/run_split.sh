#!/usr/bin/env bash
# `make test`: the suite as two pytest processes at once. The tests that run on a Ray
# cluster (tests/service: one cluster for the session, one app per backend; tests/e2e:
# each starts processes and clusters of its own, and one checks what Ray recorded on this
# machine) run in this process, one at a time; the engine's own tests (tests/unit, no Ray),
# the chart's (tests/deploy) and tests/gpu (deselected without a GPU) run beside them, and
# their report follows. Exit 1 when either failed.
#
# Usage: tests/run_split.sh [PYTHON] [pytest args for both...]
set -u
py=${1:-.venv/bin/python}
shift || true
log=$(mktemp "${TMPDIR:-/tmp}/rlplane-engine-tests-XXXXXX")
echo "tests/unit, tests/deploy and tests/gpu run beside these (their report follows at the end)"
"$py" -m pytest tests/unit tests/deploy tests/gpu -q -p no:cacheprovider "$@" > "$log" 2>&1 &
engine=$!
trap 'kill "$engine" 2>/dev/null; rm -f "$log"' INT TERM
"$py" -m pytest tests/service tests/e2e -q "$@"
ray=$?
wait "$engine"
unit=$?
echo
echo "==== tests/unit, tests/deploy, tests/gpu (ran beside the above) ===="
cat "$log"
rm -f "$log"
[ "$ray" -eq 0 ] && [ "$unit" -eq 0 ]
