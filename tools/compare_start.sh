#!/usr/bin/env bash
# Seconds from launching a server to its first answered completion, Octavo against llama.cpp's
# llama-server, same GGUF, alternated, ROUNDS rounds (medians printed at the end):
#   llama.cpp            - llama-server (any start: it maps the file and runs);
#   octavo first start   - `octavo serve FILE` on an empty cache (only the built kernels linked in):
#                          the file converted, its layers prepared and written for the next start;
#   octavo later start   - the same again, the cache now filled.
# The GGUF is read once before the rounds so that every start finds it in the page cache.
#   MODEL=/work/bench/llama-3.2-1b.Q4_K_M.gguf OCTAVO_FLAGS="--activation-dtype int8" tools/compare_start.sh
# Env: MODEL (a .gguf path or a packaged model name; default the embedded SmolLM2), ROUNDS (3),
#      OCTAVO_FLAGS (extra serve flags), OUT (logs; default bench-results/start), BASELINE (another
#      checkout, e.g. a `git worktree` of an older commit: its starts measured too, same venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-bench-results/start}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
LLAMA=$(tools/build_llama_server.sh)
GGUF=$($PY -c "
import sys
from pathlib import Path
from octavo.models.loader import PACKAGED_MODELS, default_gguf_path, packaged_gguf
m = sys.argv[1]
print(default_gguf_path() if not m else packaged_gguf(m) if m in PACKAGED_MODELS else Path(m).resolve())" "${MODEL:-}")
KERNELS=$($PY -c "from octavo.cache import cache_dir; print(cache_dir() / 'kernels')")
THREADS=$(nproc)
cat "$GGUF" > /dev/null
PORT=$((20000 + RANDOM % 10000))

# first_answer LABEL CMD...: launch CMD (a server on $PORT), POST a completion until it answers 200
first_answer() {
  local label=$1; shift
  local start end pid deadline
  start=$(date +%s.%N)
  "$@" >"$OUT/$label.log" 2>&1 &
  pid=$!
  deadline=$(( $(date +%s) + 900 ))
  until curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" \
      -H 'Content-Type: application/json' -d '{"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
      "temperature": 0}' 2>/dev/null | grep -q 200; do
    if ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -gt "$deadline" ]; then
      echo "$label: no answer (the server exited or 900 s passed); log: $OUT/$label.log" >&2
      kill "$pid" 2>/dev/null || true; return 1
    fi
    sleep 0.05
  done
  end=$(date +%s.%N)
  local rss
  rss=$(awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$label $(echo "$end - $start" | bc) $rss" | tee -a "$OUT/starts.txt"
}

: > "$OUT/starts.txt"
for round in $(seq 1 "$ROUNDS"); do
  first_answer llama.cpp "$LLAMA" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -c 4096 --host 127.0.0.1 --port "$PORT"
  CACHE=$(mktemp -d)
  ln -s "$KERNELS" "$CACHE/kernels"
  first_answer octavo-first-start env OCTAVO_CACHE_DIR="$CACHE" OMP_NUM_THREADS="$THREADS" \
    .venv/bin/octavo serve "$GGUF" --served-model-name m --port "$PORT" ${OCTAVO_FLAGS:-}
  first_answer octavo-later-start env OCTAVO_CACHE_DIR="$CACHE" OMP_NUM_THREADS="$THREADS" \
    .venv/bin/octavo serve "$GGUF" --served-model-name m --port "$PORT" ${OCTAVO_FLAGS:-}
  rm -rf "$CACHE"
  if [ -n "${BASELINE:-}" ]; then
    CACHE=$(mktemp -d)
    ln -s "$KERNELS" "$CACHE/kernels"
    for label in baseline-first-start baseline-later-start; do
      # (run from the baseline's folder: `python -m` puts the working directory first on the path)
      first_answer "$label" env -C "$BASELINE" OCTAVO_CACHE_DIR="$CACHE" OMP_NUM_THREADS="$THREADS" \
        "$PWD/.venv/bin/python" -m octavo serve "$GGUF" --served-model-name m --port "$PORT" ${OCTAVO_FLAGS:-}
    done
    rm -rf "$CACHE"
  fi
done
echo "## median seconds to the first answer (resident MiB then), $ROUNDS rounds: $(basename "$GGUF")"
$PY - "$OUT/starts.txt" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    label, seconds, rss = line.split()
    rows.setdefault(label, []).append((float(seconds), int(rss)))
base = statistics.median(s for s, _ in rows["llama.cpp"])
for label, runs in rows.items():
    med = statistics.median(s for s, _ in runs)
    print(f"{label:20s} {med:7.2f} s  {med / base:5.2f}x llama.cpp  {int(statistics.median(r for _, r in runs)):6d} MiB")
EOF
