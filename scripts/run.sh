#!/usr/bin/env bash
# The main job: `bash scripts/run.sh` runs `dflash generate` on the built-in default
# model; any arguments replace the default command (`bash scripts/run.sh validate x.json`).
set -euo pipefail
source "$(dirname "$0")/_venv.sh" ""
if [ "$#" -eq 0 ]; then set -- generate; fi
exec dflash "$@"
