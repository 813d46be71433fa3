#!/usr/bin/env bash
# The test command: installs the test dependencies into .venv, then runs the CPU suite
# (Triton kernels under the interpreter), mypy --strict, ruff, and a short fuzz smoke run.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "[test]"
cd "$root"
export TRITON_INTERPRET=1
echo "== ruff"; ruff check .
echo "== mypy --strict"; mypy --strict dflash
echo "== pytest (CPU suite)"; python -m pytest tests/cpu -q "$@"
echo "== fuzz smoke"; python -m dflash.cli fuzz --seconds 20 --report "${TMPDIR:-/tmp}/dflash-fuzz-smoke.json"
