#!/usr/bin/env bash
# The performance benchmark, from a fresh clone: bash bench/run.sh [options; --help lists them]
#
# Generates the default project into build/bench/project, writes the shipped real MNIST sample
# into build/bench/data, measures the template against plain PyTorch (about 9 minutes on 2 CPU
# cores), prints a table and writes build/bench/results.json. VENV=/path/to/venv uses an
# existing environment instead of creating .venv (see scripts/venv.sh).
# bash bench/run.sh checkpoint-store [options]: checkpoint save and upload times against preemption
# grace periods instead (bench/checkpoint_store.py; 7-18 minutes, about 12 GB of memory at its peak).
# bash bench/run.sh sharded [options]: the sharded strategy against DDP, steps/s and checkpoint saves in the
# background against saves that hold training up (bench/sharded.py; writes build/bench/sharded.json).
# bash bench/run.sh stop [options]: SIGTERM to exit on one process, quiet and beside another training
# (bench/stop_latency.py; about 5 minutes).
# bash bench/run.sh parts [options]: where the template's time per step goes, part by part (bench/step_parts.py;
# about a minute).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/venv.sh"
cd "$ROOT"
if [ "${1:-}" = checkpoint-store ]; then
    shift
    exec "$PYTHON" bench/checkpoint_store.py "$@"
fi
if [ "${1:-}" = stop ]; then
    shift
    exec "$PYTHON" bench/stop_latency.py "$@"
fi
if [ "${1:-}" = parts ]; then
    shift
    exec "$PYTHON" bench/step_parts.py "$@"
fi
if [ "${1:-}" = sharded ]; then
    shift
    exec "$PYTHON" bench/sharded.py "$@"
fi
exec "$PYTHON" bench/benchmark.py "$@"
