#!/usr/bin/env bash
# The device check: build, CUDA tests and every GPU benchmark, on one machine with one
# NVIDIA GPU (an H100 or H200 lent to a session), in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh [--no-tests] [--no-build] [--budget SECONDS]
#
# Run from anywhere; it works in the repository root.  It expects a fresh machine with the
# working tree only (no build outputs): it builds the extensions in place, with the machine's
# python3 (the one that holds torch) and nvcc.  Each step runs under its own `timeout`, and a
# failed step never stops the ones after it.  The whole run stops starting steps once
# --budget seconds (default 450) are spent, so that two runs fit in 15 minutes of device time.
#
# Python packages the machine lacks (it cannot reach a package index) travel as wheels in
# .whl/ at the repository root, which this script installs first (pip --prefix); for MPI that
# is the `mpich` wheel for the machine's Python (see docs/gpus.md, "Running the device check").
#
# Output: JSON under benchmarks/results/ named <what>_<gpu>_<date>.json, each with the GPU in
# its machine block; a log (/tmp/gpu_check.log); and a summary line per step.  Where $OUT is set (the device tool's
# folder of files to bring back), the JSON files and the log are copied there too.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)

BUDGET=450
RUN_TESTS=1
RUN_BUILD=1
while [ $# -gt 0 ]; do
    case "$1" in
        --no-tests) RUN_TESTS=0 ;;
        --no-build) RUN_BUILD=0 ;;
        --budget) shift; BUDGET=${1:?--budget needs a number of seconds} ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in
    ''|*[!0-9]*) echo "gpu_check.sh: --budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
LOG=/tmp/gpu_check.log
: > "$LOG"
START=$SECONDS
SUMMARY=()
FAILED=0
JSONS=()

log() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S COMMAND...: run under timeout, capped by what is left of the budget.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 15 ]; then
        log "== $name: not run (budget of ${BUDGET}s spent)"
        SUMMARY+=("$name: NOT RUN (budget spent)")
        FAILED=1
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("$name: ok (${took}s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("$name: TIMED OUT after ${took}s")
        FAILED=1
    else
        SUMMARY+=("$name: FAILED rc=$rc (${took}s)")
        FAILED=1
    fi
    return 0
}

# ---- environment -----------------------------------------------------------------------
if compgen -G ".whl/*.whl" > /dev/null; then
    # --prefix, not --target: the mpich wheel's libmpi and mpiexec are data files, which
    # --target drops.
    log "== installing carried wheels: $(ls .whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --prefix /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
    SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib", vars={"base": "/tmp/site", "platbase": "/tmp/site"}))')
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
log "== machine: GPU ${GPU:-none found by nvidia-smi}; $("$PY" --version 2>&1); $(nproc) cores"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available(), "devices", torch.cuda.device_count())
try:
    from mpi4py import MPI
    print("MPI:", MPI.Get_library_version().splitlines()[0])
except Exception as exc:  # a missing MPI is reported, and every MPI step then fails on its own
    print("MPI: not usable:", exc)
    print("MPI: carry the mpich wheel in .whl/ (docs/gpus.md, 'Running the device check')")
EOF
# The GPU's short name for file names: "NVIDIA H100 80GB HBM3" -> h100.
TAG=$(echo "${GPU:-gpu}" | tr '[:upper:]' '[:lower:]' | grep -o 'h[0-9]\{3\}\|a[0-9]\{3\}\|l[0-9]\{2\}' | head -n 1)
TAG=${TAG:-gpu}
DATE=$(date -u +%F)
MPIEXEC=$(command -v mpiexec || echo mpiexec)

# ---- build -----------------------------------------------------------------------------
if [ "$RUN_BUILD" = 1 ]; then
    # sm_90 only (H100 and H200; its PTX JITs for anything newer): half the nvcc time of the
    # default list.  Each extension's sources compile in parallel (AIAK_BUILD_JOBS); the
    # extensions themselves one after another (setup.py's per-extension flags need that).
    step build 240 env AIAK_CUDA_ARCHS="${AIAK_CUDA_ARCHS:-90}" AIAK_BUILD_JOBS="$(nproc)" \
        "$PY" setup.py -q build_ext --inplace
    step check_build 30 "$PY" -c "
from aiak_training.runner.cli.check_build import check_build_text
from aiak_training.common.gpu import kernels
print(check_build_text())
assert kernels.library() is not None, 'CUDA kernel library: ' + str(kernels.error())"
fi

# ---- tests -----------------------------------------------------------------------------
if [ "$RUN_TESTS" = 1 ]; then
    # Every CUDA test file: the known ones, any test_*cuda*.py added since, and the DGC device tests.
    TESTS=(tests/test_cuda.py tests/test_fused_optim_cuda.py tests/test_gpu_path.py)
    for f in tests/test_*cuda*.py tests/test_dgc_device.py; do
        if [ -f "$f" ] && [[ " ${TESTS[*]} " != *" $f "* ]]; then
            TESTS+=("$f")
        fi
    done
    step cuda_tests 210 "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}"
fi

# ---- benchmarks ------------------------------------------------------------------------
# bench NAME LIMIT_S JSON COMMAND...: a step whose JSON is kept when it was written.
bench() {
    local name=$1 limit=$2 json=$3
    shift 3
    rm -f "$json"
    step "$name" "$limit" "$@"
    [ -s "$json" ] && JSONS+=("$json")
    return 0
}
R=$RESULTS
bench gpu_grouped 60 "$R/gpu_grouped_1rank_${TAG}_${DATE}.json" \
    "$PY" benchmarks/gpu_bench.py --bench grouped --json "$R/gpu_grouped_1rank_${TAG}_${DATE}.json"
bench gpu_step 90 "$R/gpu_step_overhead_${TAG}_${DATE}.json" \
    "$PY" benchmarks/gpu_bench.py --bench step --json "$R/gpu_step_overhead_${TAG}_${DATE}.json"
bench gpu_staged 60 "$R/gpu_staged_2ranks_${TAG}_${DATE}.json" \
    env CUDA_VISIBLE_DEVICES=0 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_bench.py --bench staged \
    --json "$R/gpu_staged_2ranks_${TAG}_${DATE}.json"
bench fused_optim_cuda 75 "$R/fused_optim_cuda_${TAG}_${DATE}.json" \
    "$PY" benchmarks/fused_optim_bench.py --device cuda --reps 5 --json "$R/fused_optim_cuda_${TAG}_${DATE}.json"
bench dgc_cuda_select 45 "$R/dgc_cuda_select_${TAG}_${DATE}.json" \
    "$PY" benchmarks/dgc_bench.py --select-only --device cuda --reps 5 --json "$R/dgc_cuda_select_${TAG}_${DATE}.json"
bench allreduce_cuda 45 "$R/allreduce_cuda_1rank_${TAG}_${DATE}.json" \
    "$PY" benchmarks/allreduce_bench.py --device cuda --no-gloo --json "$R/allreduce_cuda_1rank_${TAG}_${DATE}.json"

# ---- summary ---------------------------------------------------------------------------
log "== summary ($((SECONDS - START))s of a ${BUDGET}s budget; GPU ${GPU:-unknown})"
for line in "${SUMMARY[@]}"; do
    log "  $line"
done
for json in ${JSONS[@]+"${JSONS[@]}"}; do
    "$PY" - "$json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
with open(sys.argv[1]) as f:
    data = json.load(f)
ratios = ", ".join(f"{k}={v:.3f}" for k, v in data.get("ratios", {}).items())
print(f"  {sys.argv[1]}: {ratios} (gpu: {data['machine'].get('gpu')})")
EOF
done
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    # The device tool brings back at most 8 files: the JSON (6 at most) and the log.
    [ "${#JSONS[@]}" -gt 0 ] && cp "${JSONS[@]}" "$OUT"/
    cp "$LOG" "$OUT"/
fi
exit "$FAILED"
