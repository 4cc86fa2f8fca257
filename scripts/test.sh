#!/usr/bin/env bash
# Set up, then run the test suite: fast unit tests first, two at a time (pytest-xdist: most are single-threaded
# Python, so the second core would idle), then the slow real-model ones one by one (each uses both cores, and vLLM's
# and llama.cpp's runs need the memory). On an AVX-512 host the kernel tests run a second time with torch's and the
# project's AVX2 code paths forced (ATEN_CPU_CAPABILITY=avx2), so both CPU kinds' code is exercised whichever host
# runs this.
# Every stage runs whatever the one before did; the script exits non-zero at the end if any stage failed or collected
# no tests (pytest's exit code 5), naming each.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
export WANDB_MODE=disabled

failed=()
run() {  # run SELECTION WORKERS [ENV=VALUE...]: pytest -m SELECTION in WORKERS processes (0: this one), with the
         # environment given; a failure is recorded, not fatal
    local selection=$1 workers=$2 rc
    shift 2
    env "$@" python -m pytest -m "$selection" -n "$workers" -p no:cacheprovider --durations=12
    rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "no tests collected for -m '$selection': treating as a failure" >&2
    fi
    if [ "$rc" -ne 0 ]; then
        failed+=("-m '$selection' ${*:-} (pytest exit $rc)")
    fi
}

run "not slow" 2
if grep -qw avx512f /proc/cpuinfo; then
    run "cpu_kernels and not slow" 0 ATEN_CPU_CAPABILITY=avx2
fi
run "slow" 0
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'failed stage: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "every stage passed"
