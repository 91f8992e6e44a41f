#!/usr/bin/env bash
# Cache-aware scheduling against first come, first served with a model (docs/BENCHMARKS.md): two
# `octavo serve`s with the same pool of $POOL blocks (default 288: 4,608 tokens, a quarter of the
# working set: 16 system prompts of 1,024 tokens and 32 requests' own suffixes and answers), one
# --scheduling-policy fcfs, one cache-aware; `octavo bench serve prefix-repetition` sends each in
# turn $NUM requests (16 prompts round robin + a 32-token suffix, 32 tokens out; $COLD of them cold,
# a 1,024-token prefix of their own) from $CONC clients at once, $REPEATS rounds of fresh prompts,
# rotating which server goes first. The table: medians, latencies, cold requests' TTFT, and the
# servers' own counts of prompt tokens reused and computed, preemptions and tokens recomputed.
# Usage: tools/compare_scheduling.sh   (POOL, NUM, CONC, COLD, REPEATS, PREFIX, EXTRA override; EXTRA:
# flags for both servers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POOL=${POOL:-288}; NUM=${NUM:-256}; CONC=${CONC:-32}; COLD=${COLD:-0.1}; REPEATS=${REPEATS:-2}; PREFIX=${PREFIX:-1024}
LOGS=$(mktemp -d)
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "waited 450 s for $1" >&2; exit 1; }
serve() {  # name port flags...
  local name=$1 p=$2; shift 2
  # shellcheck disable=SC2086
  "$PY" -m octavo.cli serve --port "$p" --max-model-len 2048 --log-interval 30 --num-kv-blocks "$POOL" ${EXTRA:-} "$@" \
    >> "$LOGS/$name.log" 2>&1 &
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
p_aware=$(port); p_fcfs=$(port)
serve cache-aware "$p_aware" --scheduling-policy cache-aware
serve fcfs "$p_fcfs" --scheduling-policy fcfs
wait_up "http://127.0.0.1:$p_aware"; wait_up "http://127.0.0.1:$p_fcfs"
echo "== shared prefixes: 16 x $PREFIX tokens, $NUM requests ($COLD cold), $CONC clients, pool $POOL blocks"
"$PY" -m octavo.cli bench serve prefix-repetition --num-requests "$NUM" --num-prefixes 16 --prefix-len "$PREFIX" \
  --suffix-len 32 --output-len 32 --cold-fraction "$COLD" --max-concurrency "$CONC" --warmup 0 \
  --base-url "http://127.0.0.1:$p_aware" --compare "http://127.0.0.1:$p_fcfs" --labels cache-aware,fcfs \
  --repeats "$REPEATS" --json "$LOGS/compare.json" 2>&1 | grep -v -E "^(INFO|WARNING)|bench serve"
echo "logs: $LOGS"
