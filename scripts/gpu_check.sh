#!/usr/bin/env bash
# Prove a GPU machine with a generated project (about 5 minutes on one GPU; see bench/gpu_check.py):
#   bash scripts/gpu_check.sh [--dry-run] [--out build/gpu_check]
# --dry-run runs the same checks on the CPU. PYTHON=/path/to/python uses an environment that already
# holds the project's dependencies and cookiecutter (a machine without network); otherwise .venv is
# made as for the tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    source "$ROOT/scripts/venv.sh"
fi
cd "$ROOT"
exec "$PYTHON" bench/gpu_check.py "$@"
