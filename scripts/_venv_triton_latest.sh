# Sourced by test.sh: a second environment with the newest supported triton
# (constraints/triton-latest.txt), for the kernel interpreter tests only. Created on first
# use inside the main environment's folder ($venv/triton-latest, ignored like .venv) and
# reinstalled only when the pins or pyproject.toml change; DFLASH_VENV_LATEST overrides
# the location. Needs $root and $venv from _venv.sh.
set -euo pipefail
latest="${DFLASH_VENV_LATEST:-$venv/triton-latest}"
pins="$root/constraints/triton-latest.txt"
if [ ! -x "$latest/bin/python" ]; then
  python3 -m venv "$latest"
  "$latest/bin/python" -m pip install -q --upgrade pip
fi
latest_stamp="$latest/.dflash-installed"
if [ ! -f "$latest_stamp" ] || [ "$pins" -nt "$latest_stamp" ] \
    || [ "$root/pyproject.toml" -nt "$latest_stamp" ]; then
  # dflash itself plus what the kernel tests import (tests/conftest.py needs hypothesis)
  "$latest/bin/python" -m pip install -q -c "$pins" -e "$root" pytest hypothesis
  touch "$latest_stamp"
fi
