#!/usr/bin/env bash
# README command 2: set up, then run the test suite.
# Tests run in CNNPIPE_TEST_WORKERS processes (pytest-xdist, default 2): many of them wait on
# subprocess start-ups, rendezvous and checkpoints rather than compute. `-n 0` runs them in this
# process (what a debugger wants); any pytest option may follow, e.g. a test's node id.
# Each process a test starts gets one thread (two workers share the cores; tests that measure threads
# set their own) and DVC without analytics (its report files would litter the temp folder);
# tests/suite_plugin.py sets the same for a bare `python -m pytest`.
set -euo pipefail
cd "$(dirname "$0")/.."
setup_start=$(date +%s)
bash scripts/setup.sh
echo "test.sh: setup took $(( $(date +%s) - setup_start )) s"
export PATH="$PWD/.venv/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" DVC_NO_ANALYTICS=1
exec python -m pytest -n "${CNNPIPE_TEST_WORKERS:-2}" --dist worksteal "$@"
