# Sourced by run.sh and test.sh: creates .venv on first use and installs dflash into it.
# DFLASH_VENV overrides the location; the CPU build of torch is pinned by constraints/cpu.txt
# unless DFLASH_TORCH=own (keep the torch already in the environment, e.g. a CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DFLASH_VENV:-$root/.venv}"
extras="${1:-}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
constraint=(-c "$root/constraints/cpu.txt")
if [ "${DFLASH_TORCH:-}" = "own" ]; then constraint=(); fi
stamp="$venv/.dflash-installed$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q "${constraint[@]}" -e "$root$extras"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
