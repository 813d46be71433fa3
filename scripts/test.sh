#!/usr/bin/env bash
# The test command: installs the test dependencies into .venv, then runs the CPU suite
# (Triton kernels under the interpreter), mypy --strict, ruff, the kernel tests again under
# the newest supported triton (a second environment, constraints/triton-latest.txt; set
# DFLASH_TRITON_MATRIX=0 to skip it), and a short fuzz smoke run.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "[test]"
cd "$root"
export TRITON_INTERPRET=1
echo "== ruff"; ruff check .
echo "== mypy --strict (dflash, tests)"; mypy --strict dflash tests
echo "== pytest (CPU suite)"; python -m pytest tests/cpu -q "$@"
if [ "${DFLASH_TRITON_MATRIX:-1}" != "0" ]; then
  source "$root/scripts/_venv_triton_latest.sh"
  echo "== pytest (kernels, $("$latest/bin/python" -c 'import triton; print("triton", triton.__version__)'))"
  "$latest/bin/python" -m pytest tests/cpu/kernels -q
fi
echo "== fuzz smoke"; python -m dflash.cli fuzz --seconds 20 --report "${TMPDIR:-/tmp}/dflash-fuzz-smoke.json"
