#!/usr/bin/env bash
# On a CUDA machine (a CUDA build of torch and the project's other dependencies installed; scripts/setup.sh would
# install the CPU wheel, so it is not run here): the `gpu` tests, then the main job shrunk with device=cuda, then
# decode.costs and decode.bench on the GPU; every stage's wall time at the end. Extra arguments are Hydra overrides
# for the stages (e.g. `model.name=/path/to/hf/model`). Exits with the first failure's code (decode.eval's 3,
# "no chain admissible", is a verdict, not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE="${WANDB_MODE:-disabled}"
run_dir="${POLYSPEC_GPU_RUN_DIR:-runs/gpu}"
log="$run_dir/stage_times.txt"
mkdir -p "$run_dir"
: >"$log"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "error: no CUDA device here (torch.cuda.is_available() is False)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"

small=(
    "run_dir=$run_dir" device=cuda
    train.max_conversations=64 train.max_len=256 train.max_steps=40 train.eval_every=0 train.checkpoint_every=1000
    train.eval.conversations=4 train.eval.gen_tokens=32
    quantize.calibration.samples=16 quantize.eval.ppl_conversations=8 quantize.eval.agreement_prompts=4
    eval=smoke eval.max_new_tokens=64
)

stage() {  # stage NAME COMMAND...: run it, log its wall time and exit code
    local name=$1 start rc
    shift
    start=$(date +%s.%N)
    "$@"
    rc=$?
    printf '%-16s %8.1f s  exit %d\n' "$name" "$(echo "$(date +%s.%N) - $start" | bc)" "$rc" | tee -a "$log"
    return "$rc"
}

stage "pytest -m gpu" python -m pytest -m gpu -p no:cacheprovider -q -rs || exit $?
stage train.eagle python -m train.eagle "${small[@]}" "$@" || exit $?
stage quantize.w4 python -m quantize.w4 quantize.overwrite=true "${small[@]}" "$@" || exit $?
stage decode.eval python -m decode.eval "${small[@]}" "$@"
rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || exit "$rc"
stage decode.costs python -m decode.costs "${small[@]}" "$@" || exit $?
stage decode.bench python -m decode.bench "${small[@]}" "$@" || exit $?
echo
echo "stage times ($log):"
cat "$log"
echo "store tokens/s: $run_dir/eagle_features/*/meta.json; head tokens/s and steps: $run_dir/eagle/metrics.json;"
echo "GPTQ seconds: $run_dir/w4/metrics.json (quantize_s); forward ms per level: $run_dir/costs.json;"
echo "chain speedups: $run_dir/bench/bench.json and $run_dir/eval/report.md"
