#!/usr/bin/env bash
# Router policies side by side (docs/BENCHMARKS.md): for each policy, two fresh `octavo serve`
# replicas (one thread each, a KV cache of $KV, default 224MiB: about 5,100 tokens, room for four of
# the eight prefixes and the running requests) behind
# `octavo router`, then `octavo bench serve` with 8 shared prefixes of 1,024 tokens, 256 requests.
# Prints each policy's throughput and the replicas' prefix-cache hit rate.
# Usage: tools/compare_router.sh [policies...]   (default: cache-aware round-robin)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POLICIES=${*:-cache-aware round-robin}
LOGS=$(mktemp -d)
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "no $1" >&2; exit 1; }
metric() { curl -s "$1/metrics" | awk -v m="$2" '$1 ~ "^octavo:"m"_total" {s += $2} END {print s + 0}'; }

for policy in $POLICIES; do
  pids=(); urls=()
  for i in 0 1; do
    p=$(port)
    OMP_NUM_THREADS=1 "$PY" -m octavo.cli serve --port "$p" --kv-cache-memory "${KV:-224MiB}" --max-num-seqs 8 \
      --max-model-len 2048 --log-interval 30 > "$LOGS/$policy-replica$i.log" 2>&1 &
    pids+=($!); urls+=("http://127.0.0.1:$p")
  done
  for u in "${urls[@]}"; do wait_up "$u"; done
  rp=$(port)
  "$PY" -m octavo.cli router --policy "$policy" --port "$rp" --worker "${urls[0]}" --worker "${urls[1]}" \
    > "$LOGS/$policy-router.log" 2>&1 &
  pids+=($!)
  wait_up "http://127.0.0.1:$rp"
  echo "== $policy"
  OMP_NUM_THREADS=1 "$PY" -m octavo.cli bench serve prefix-repetition --base-url "http://127.0.0.1:$rp" \
    --num-prefixes 8 --prefix-len 1024 --suffix-len 64 --num-requests 256 --output-len 32 --seed 0 \
    --max-concurrency 16 2>&1 | grep -v -E "^(INFO|WARNING)" | tail -n 12
  q=0; h=0
  for u in "${urls[@]}"; do q=$((q + $(metric "$u" prefix_cache_queries | cut -d. -f1))); h=$((h + $(metric "$u" prefix_cache_hits | cut -d. -f1))); done
  echo "replicas' prefix-cache hit rate ($policy): $h / $q prompt tokens = $("$PY" -c "print(f'{$h / max($q, 1):.1%}')")"
  curl -s "http://127.0.0.1:$rp/metrics" | grep -E '^octavo_router_requests_total' || true
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
done
echo "logs: $LOGS"
