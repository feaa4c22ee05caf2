#!/usr/bin/env bash
# README command 2: set up, then run the test suite.
# Tests run in CNNPIPE_TEST_WORKERS processes (pytest-xdist, default 2): many of them wait on
# subprocess start-ups, rendezvous and checkpoints rather than compute. `-n 0` runs them in this
# process (what a debugger wants); any pytest option may follow, e.g. a test's node id.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -n "${CNNPIPE_TEST_WORKERS:-2}" --dist worksteal "$@"
