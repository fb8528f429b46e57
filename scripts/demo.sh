#!/usr/bin/env bash
# Generate a project with the default answers and train it on the shipped real MNIST sample (CPU, offline).
# bash scripts/demo.sh [output dir, default build/demo]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
exec "$PYTHON" "$ROOT/scripts/demo.py" "$@"
