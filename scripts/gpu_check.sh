#!/usr/bin/env bash
# Prove a GPU machine with a generated project, one PASS/WARN/FAIL/SKIP line per check (bench/gpu_check.py):
#   bash scripts/gpu_check.sh [--dry-run] [--out build/gpu_check]
# About 3 minutes on one GPU; 2 GPUs add the NCCL checks. --dry-run runs the same checks on the CPU.
# PYTHON=/path/to/python uses an environment that already holds the project's dependencies and
# cookiecutter (a machine without network); otherwise .venv is made as for the tests (scripts/venv.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    source "$ROOT/scripts/venv.sh"
fi
cd "$ROOT"
exec "$PYTHON" bench/gpu_check.py "$@"
