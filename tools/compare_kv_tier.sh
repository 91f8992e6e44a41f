#!/usr/bin/env bash
# The second KV tier on a multi-turn chat workload (docs/BENCHMARKS.md): three `octavo serve`s side
# by side, a pool of $POOL blocks (default 128: 2,048 tokens) without a tier ("off") and with a
# $TIER tier on disk ("tier"), and a pool big enough for everything ("unbounded", 4,096 blocks);
# `octavo bench serve multi-turn` runs the same conversations on each in turn, $REPEATS rounds of
# fresh ones: $CONVERSATIONS conversations of $TURNS turns all open at once (working set 5x the
# small pool), at most $MAXCONC requests in flight, 1 s mean think time, $SYSTEM-token system
# prompts. Then random prompts that miss everywhere, tier vs off (what the tier's writes cost a
# miss; run last, as its misses push the conversations out of the tier). Before it, the tier's
# server is stopped (it writes its pool's cached blocks) and started again on the same folder, and
# round 1's conversations are replayed against it and against a fresh server with an empty tier:
# first turns' TTFT, warm (from the tier) vs cold. ONLY=restart runs round 1 once, then that;
# ONLY=misses runs only the misses (on a fresh tier); MISSES=0 leaves them out. Comparisons rotate
# which server goes first each round (the first runs a few percent slower, whichever it is).
# Usage: tools/compare_kv_tier.sh   (POOL, TIER, REPEATS, CONVERSATIONS, TURNS, MAXCONC, SYSTEM, MISS_REPEATS override)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POOL=${POOL:-128}; TIER=${TIER:-2GiB}; REPEATS=${REPEATS:-3}
CONV=${CONVERSATIONS:-16}; TURNS=${TURNS:-4}; MAXCONC=${MAXCONC:-4}; SYSTEM=${SYSTEM:-256}
LOGS=$(mktemp -d); TIER_DIR="$LOGS/tier"; COLD_DIR="$LOGS/cold-tier"
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "waited 450 s for $1" >&2; exit 1; }
serve() {  # name port flags...
  local name=$1 p=$2; shift 2
  "$PY" -m octavo.cli serve --port "$p" --max-model-len 2048 --log-interval 30 "$@" >> "$LOGS/$name.log" 2>&1 &
  echo $!
}
bench() {  # seed repeats url [--compare url ...] --labels ...
  local seed=$1 repeats=$2; shift 2
  "$PY" -m octavo.cli bench serve multi-turn --num-conversations "$CONV" --turns "$TURNS" --system-len "$SYSTEM" \
    --user-len 64 --output-len 32 --think-time 1 --max-concurrency "$MAXCONC" --seed "$seed" --repeats "$repeats" "$@" 2>&1 \
    | grep -v -E "^(INFO|WARNING)|bench multi-turn"
}
misses() {  # tier_url off_url: random prompts, $MISS_REPEATS rounds, each server first in half of them
  echo "== random prompts that miss everywhere (512 tokens, 16 out, 4 at once)"
  "$PY" -m octavo.cli bench serve random --num-requests 24 --input-len 512 --output-len 16 --max-concurrency 4 \
    --seed 1000 --base-url "$1" --compare "$2" --labels tier,off --repeats "${MISS_REPEATS:-6}" \
    2>&1 | grep -v -E "^(INFO|WARNING)|bench serve"
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
p_off=$(port); p_tier=$(port); p_big=$(port)
pid_off=$(serve off "$p_off" --num-kv-blocks "$POOL")
pid_tier=$(serve tier "$p_tier" --num-kv-blocks "$POOL" --kv-offload-size "$TIER" --kv-offload-path "$TIER_DIR")
if [ "${ONLY:-}" = misses ]; then
  wait_up "http://127.0.0.1:$p_tier"; wait_up "http://127.0.0.1:$p_off"
  misses "http://127.0.0.1:$p_tier" "http://127.0.0.1:$p_off"
  echo "logs: $LOGS"; exit 0
fi
if [ "${ONLY:-}" != restart ]; then
  pid_big=$(serve unbounded "$p_big" --num-kv-blocks 4096)
  for p in "$p_off" "$p_tier" "$p_big"; do wait_up "http://127.0.0.1:$p"; done
  echo "== multi-turn: tier vs off vs unbounded pool"
  bench 0 "$REPEATS" --base-url "http://127.0.0.1:$p_tier" --compare "http://127.0.0.1:$p_off" \
    --compare "http://127.0.0.1:$p_big" --labels tier,off,unbounded
  kill "$pid_big"
else  # only the restart: round 1's conversations once, to fill the tier
  wait_up "http://127.0.0.1:$p_tier"; wait_up "http://127.0.0.1:$p_off"
  bench 0 1 --base-url "http://127.0.0.1:$p_tier" --labels tier > /dev/null
fi
kill "$pid_tier"
while kill -0 "$pid_tier" 2>/dev/null; do sleep 0.2; done  # (not our child: wait cannot)
grep -h "KV tier closed" "$LOGS/tier.log" || true
p_warm=$(port); p_cold=$(port)
pid_warm=$(serve tier "$p_warm" --num-kv-blocks "$POOL" --kv-offload-size "$TIER" --kv-offload-path "$TIER_DIR")
serve cold "$p_cold" --num-kv-blocks "$POOL" --kv-offload-size "$TIER" --kv-offload-path "$COLD_DIR" > /dev/null
wait_up "http://127.0.0.1:$p_warm"; wait_up "http://127.0.0.1:$p_cold"
grep -h "kept from before" "$LOGS/tier.log" | tail -n 1
echo "== after a restart: round 1's conversations again, warm tier vs an empty one"
bench 0 1 --base-url "http://127.0.0.1:$p_warm" --compare "http://127.0.0.1:$p_cold" --labels warm-restart,cold
if [ "${ONLY:-}" != restart ] && [ "${MISSES:-1}" != 0 ]; then  # last: its misses push the conversations out of the tier
  misses "http://127.0.0.1:$p_warm" "http://127.0.0.1:$p_off"
fi
echo "logs: $LOGS"
