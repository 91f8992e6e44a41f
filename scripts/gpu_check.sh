#!/usr/bin/env bash
# The first run on a GPU box: the GPU tests, then scripts/gpu_check.py (kernels vs reference,
# oracle, CUDA graphs, 8B decode roofline and throughput), one table last. Needs no network and
# no checkpoint; fits in 8 minutes on an H200. Usage: scripts/gpu_check.sh LOG_DIR [gpu_check.py flags]
set -u
LOG_DIR=${1:-gpu_check_logs}
shift || true
mkdir -p "$LOG_DIR"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels on the GPU
PY=${PYTHON:-python3}
START=$(date +%s)

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git here)"
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
} > "$LOG_DIR/env.txt"
cat "$LOG_DIR/env.txt"

# GPU-side tests (compiled Triton kernels, CUDA graphs, memory profiling): ~2 minutes at most.
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/kernels/test_triton_kernels.py tests/engine/test_triton_backend.py tests/engine/test_cuda_path.py \
    > "$LOG_DIR/pytest.log" 2>&1
  echo "pytest exit $? ($(tail -n 1 "$LOG_DIR/pytest.log"))" | tee "$LOG_DIR/pytest_status.txt"
else
  echo "pytest is not installed here: GPU tests skipped (gpu_check.py's stages still compare every kernel)" \
    | tee "$LOG_DIR/pytest_status.txt"
fi

LEFT=$(( 470 - ($(date +%s) - START) ))
"$PY" scripts/gpu_check.py --log-dir "$LOG_DIR" --budget-s "$LEFT" "$@"
STATUS=$?
echo "tests: $(cat "$LOG_DIR/pytest_status.txt")"
echo "total $(( $(date +%s) - START )) s; logs in $LOG_DIR"
exit $STATUS
