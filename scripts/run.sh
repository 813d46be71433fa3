#!/usr/bin/env bash
# The main job: `bash scripts/run.sh` runs `dflash generate` on the built-in default
# model; any arguments replace the default command (`bash scripts/run.sh validate x.json`).
# The environment has everything the README's commands use: the plot and fuzz extras
# (matplotlib for `dflash bench`'s PNG, atheris and hypothesis for `dflash fuzz`) and the
# server's (fastapi and uvicorn for `dflash serve`).
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "[plot,fuzz,serve]"
if [ "$#" -eq 0 ]; then set -- generate; fi
exec dflash "$@"
