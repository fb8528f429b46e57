#!/usr/bin/env bash
# The template's whole test suite, from a fresh clone: bash scripts/test.sh [pytest args for the template's tests]
# First the kit's own suite (trainkit/tests, run once here and not in every project), then the template's.
# Each runs TEST_WORKERS tests at a time (default 2): most tests wait on processes they started (start-up, paced
# steps, daemons), so one at a time leaves a core idle. The template's tests of one file stay in one worker:
# a platform's daemons (Slurm, dockerd) serve one file's tests.
# Three at a time made the kit's suite faster on a quiet machine (15.5 minutes against 17.3), but beside
# another training its multi-node drills could not form their jobs within their 20-s timeout: two at a time.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
WORKERS="${TEST_WORKERS:-2}"
(cd "$ROOT/trainkit" && "$PYTHON" -m pytest -n "$WORKERS" --dist load --durations=15)
cd "$ROOT"
exec "$PYTHON" -m pytest tests -n "$WORKERS" --dist loadfile --durations=25 "$@"
