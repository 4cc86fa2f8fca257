#!/usr/bin/env bash
# Set up, then run the test suite: fast unit tests first, then the slow real-model ones.
# Exits non-zero if any test fails or if a stage collects no tests (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
export WANDB_MODE=disabled
for selection in "not slow" "slow"; do
    python -m pytest -m "$selection" -p no:cacheprovider
    rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "no tests collected for -m '$selection': treating as a failure" >&2
        exit 5
    elif [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
done
