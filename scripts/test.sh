#!/usr/bin/env bash
# The template's whole test suite, from a fresh clone: bash scripts/test.sh [pytest args for the template's tests]
# First the kit's own suite (trainkit/tests, run once here and not in every project), then the template's.
# Most tests wait on processes they started (start-up, paced steps, timeouts, daemons), so one at a time
# leaves the cores idle. The kit's run KIT_TEST_WORKERS at a time (default 3): its multi-node drills wait
# for their jobs to form under cluster.join_timeout, not the 20-s cluster.timeout they test, so beside
# another training they only start later. The template's run TEST_WORKERS at a time (default 2), the
# tests of one file in one worker: a platform's daemons (Slurm, dockerd) serve one file's tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
KIT_WORKERS="${KIT_TEST_WORKERS:-3}"
WORKERS="${TEST_WORKERS:-2}"
(cd "$ROOT/trainkit" && "$PYTHON" -m pytest -n "$KIT_WORKERS" --dist load --durations=15)
cd "$ROOT"
exec "$PYTHON" -m pytest tests -n "$WORKERS" --dist loadfile --durations=25 "$@"
