#!/usr/bin/env bash
# The main job: set up, then run the whole pipeline on the embedded default (or on any Hydra
# overrides given as arguments, e.g. `run_name=exp1 model.name=/path/to/hf/model`):
#   train.eagle -> quantize.w4 -> decode.eval, all in runs/<run_name>/.
# Each stage skips work that is already done and valid, so a re-run after an interruption continues.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${POLYSPEC_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
export WANDB_MODE="${WANDB_MODE:-offline}"
python -m train.eagle train.resume=true train.skip_if_valid=true "$@"
python -m quantize.w4 quantize.skip_if_valid=true "$@"
python -m decode.eval "$@"
