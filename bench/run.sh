#!/usr/bin/env bash
# The performance benchmark, from a fresh clone: bash bench/run.sh [options; --help lists them]
#
# Generates the default project into build/bench/project, writes the shipped real MNIST sample
# into build/bench/data, measures the template against plain PyTorch (about 9 minutes on 2 CPU
# cores), prints a table and writes build/bench/results.json. VENV=/path/to/venv uses an
# existing environment instead of creating .venv (see scripts/venv.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/venv.sh"
cd "$ROOT"
exec "$PYTHON" bench/benchmark.py "$@"
