#!/usr/bin/env bash
# Seconds from launching `octavo serve` (default flags) to its first answered completion, and the
# server's resident memory then. Usage: tools/first_answer.sh [CACHE_DIR]  (default: the usual cache)
# An empty CACHE_DIR with only kernels/ copied in measures a start that converts the model itself.
set -u
cd "$(dirname "$0")/.."
PORT=$((20000 + RANDOM % 10000))
start=$(date +%s.%N)
if [ -n "${1:-}" ]; then export OCTAVO_CACHE_DIR=$1; fi
.venv/bin/octavo serve --port "$PORT" > /tmp/first_answer.log 2>&1 &
pid=$!
deadline=$(( $(date +%s) + 900 ))
until curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}' \
  2>/dev/null | grep -q 200; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -gt "$deadline" ]; then
    echo "no answer (server exited or 900 s passed); log: /tmp/first_answer.log"; kill "$pid" 2>/dev/null; exit 1
  fi
  sleep 0.2
done
end=$(date +%s.%N)
echo "first answer after $(echo "$end - $start" | bc) s; $(grep VmRSS /proc/$pid/status)"
kill "$pid"; wait "$pid" 2>/dev/null
