#!/usr/bin/env bash
# README command 1: set up, then run the whole pipeline on the embedded default (Fashion-MNIST).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dvc repro "$@"
# The summary a user reads first; `dvc metrics show <file>` / `dvc metrics diff` give the rest.
cat metrics/compare.md
grep -h "bottleneck" metrics/profile/report.md | sed 's/^## /profile: /'
echo "details: metrics/profile/report.md, metrics/<variant>/eval.json; curves: dvc plots show"
