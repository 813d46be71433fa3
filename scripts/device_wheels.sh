#!/usr/bin/env bash
# Fills .whl/ with the wheels the device machine lacks, for its Python (3.12, manylinux
# x86_64): pydantic (dflash's results and configs) and, for `dflash serve` and
# benchmarks/serve_load.py, fastapi, uvicorn, httpx, openai and what they need. Send it
# with a run as `carry: [".whl"]`; benchmarks/gpu_session.sh installs it under /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --dest .whl --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any \
  pydantic fastapi uvicorn httpx openai
ls .whl
