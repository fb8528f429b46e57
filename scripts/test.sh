#!/usr/bin/env bash
# The template's whole test suite, from a fresh clone: bash scripts/test.sh [pytest args for the template's tests]
# First the kit's own suite (trainkit/tests, run once here and not in every project), then the template's.
# The kit's suite runs KIT_TEST_WORKERS tests at a time (default 3): its drills spend about half their time waiting
# for a timeout to pass (2 at a time kept the 2 cores 51% busy through the lost-peer drills, 3 at a time 92% busy
# through the whole suite). The template's runs TEST_WORKERS at a time (default 2), and its tests of one file stay
# in one worker: a platform's daemons (Slurm, dockerd) serve one file's tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
WORKERS="${TEST_WORKERS:-2}"
KIT_WORKERS="${KIT_TEST_WORKERS:-3}"
(cd "$ROOT/trainkit" && "$PYTHON" -m pytest -n "$KIT_WORKERS" --dist load --durations=15)
cd "$ROOT"
exec "$PYTHON" -m pytest tests -n "$WORKERS" --dist loadfile --durations=25 "$@"
