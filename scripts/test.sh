#!/usr/bin/env bash
# The template's whole test suite, from a fresh clone: bash scripts/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
exec "$PYTHON" -m pytest tests --durations=25 "$@"
