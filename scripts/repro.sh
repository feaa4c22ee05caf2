#!/usr/bin/env bash
# README command 1: set up, then run the whole pipeline on the embedded default (Fashion-MNIST).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dvc repro "$@"
dvc metrics show
