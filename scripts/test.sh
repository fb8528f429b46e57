#!/usr/bin/env bash
# The template's whole test suite, from a fresh clone: bash scripts/test.sh [pytest args for the template's tests]
# First the kit's own suite (trainkit/tests, run once here and not in every project), then the template's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
(cd "$ROOT/trainkit" && "$PYTHON" -m pytest --durations=15)
cd "$ROOT"
exec "$PYTHON" -m pytest tests --durations=25 "$@"
