# Source me: create .venv at the repository root (once) and install requirements-test.txt into it.
# Afterwards $PYTHON is the environment's interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="$VENV/bin/python"
STAMP="$VENV/.requirements-test.txt"

if [ ! -x "$PYTHON" ]; then
    echo "Creating a virtual environment in $VENV"
    "${BOOTSTRAP_PYTHON:-python3}" -m venv "$VENV"
fi
if ! cmp -s "$ROOT/requirements-test.txt" "$STAMP"; then
    echo "Installing requirements-test.txt (torch is large: a few minutes the first time)"
    "$PYTHON" -m pip install --quiet --upgrade pip
    "$PYTHON" -m pip install --quiet -r "$ROOT/requirements-test.txt"
    cp "$ROOT/requirements-test.txt" "$STAMP"
fi
export PYTHON
# The tests start hundreds of Python processes. Where PYTHONDONTWRITEBYTECODE is set (many CI images
# set it), each would compile the kit's modules again; compiled once here, they are only read.
"$PYTHON" -m compileall -q "$ROOT/trainkit/src" > /dev/null
