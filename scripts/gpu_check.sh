#!/usr/bin/env bash
# The first run on a GPU box: scripts/gpu_check.py's stages (kernels vs reference, oracle, CUDA
# graphs, 8B decode roofline and throughput, the GPU tests), each in its own process under one
# deadline, the table rewritten after each. Needs no network, no checkpoint and no install beyond
# torch, triton, transformers and pytest; fits in 9 minutes on an H200 (docs/BENCHMARKS.md says
# what to run and what to do with the table).
# Usage: scripts/gpu_check.sh LOG_DIR [gpu_check.py flags, e.g. --smoke or --budget-s 400]
set -u
LOG_DIR=${1:-gpu_check_logs}
shift || true
mkdir -p "$LOG_DIR"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in
  *" --smoke "*) export TRITON_INTERPRET=1 ;;  # the CPU: Triton only in its interpreter
  *) unset TRITON_INTERPRET ;;  # compiled kernels on the GPU
esac
PY=${PYTHON:-python3}
START=$(date +%s)

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git here)"
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
} > "$LOG_DIR/env.txt" 2>&1  # moved into logs.tar.gz by gpu_check.py

"$PY" scripts/gpu_check.py --log-dir "$LOG_DIR" --budget-s 480 "$@"
STATUS=$?
echo "total $(( $(date +%s) - START )) s; table in $LOG_DIR/summary.txt, logs in $LOG_DIR/logs.tar.gz"
exit $STATUS
