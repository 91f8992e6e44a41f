#!/usr/bin/env bash
# Speculative decoding against plain decoding with the model (docs/BENCHMARKS.md): two `octavo
# serve`s, one with --speculative-method $METHOD (default ngram) and --num-speculative-tokens $K,
# one without; `octavo bench serve` sends each in turn, $REPEATS rounds of fresh prompts, rotating
# which server goes first:
#   1. code-edit: $NUM_EDIT text prompts whose answer copies the prompt's code (one name changed),
#      one client at a time, $OUT_EDIT tokens each: TPOT of one user.
#   2. random: $NUM_RAND random-token prompts (nothing to copy), $CONC clients at once: the cost
#      of leaving speculation on.
# Usage: tools/compare_speculative.sh   (METHOD, K, NUM_EDIT, OUT_EDIT, NUM_RAND, CONC, REPEATS, EXTRA override;
# EXTRA: flags for both servers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
METHOD=${METHOD:-ngram}; K=${K:-4}; NUM_EDIT=${NUM_EDIT:-6}; OUT_EDIT=${OUT_EDIT:-128}
NUM_RAND=${NUM_RAND:-48}; CONC=${CONC:-16}; REPEATS=${REPEATS:-2}
LOGS=$(mktemp -d)
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "waited 450 s for $1" >&2; exit 1; }
serve() {  # name port flags...
  local name=$1 p=$2; shift 2
  # shellcheck disable=SC2086
  "$PY" -m octavo.cli serve --port "$p" --max-model-len 2048 --log-interval 30 ${EXTRA:-} "$@" >> "$LOGS/$name.log" 2>&1 &
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
p_spec=$(port); p_off=$(port)
serve spec "$p_spec" --speculative-method "$METHOD" --num-speculative-tokens "$K"
serve off "$p_off"
wait_up "http://127.0.0.1:$p_spec"; wait_up "http://127.0.0.1:$p_off"
bench() {
  "$PY" -m octavo.cli bench serve "$@" --warmup 1 --base-url "http://127.0.0.1:$p_spec" \
    --compare "http://127.0.0.1:$p_off" --labels "$METHOD,off" --repeats "$REPEATS" 2>&1 | grep -v -E "^(INFO|WARNING)|bench serve"
}
echo "== code-edit: $NUM_EDIT requests one at a time, $OUT_EDIT tokens out, $METHOD k=$K vs off"
bench code-edit --num-requests "$NUM_EDIT" --output-len "$OUT_EDIT" --max-concurrency 1 --json "$LOGS/edit.json"
echo "== random: $NUM_RAND requests of 256 random tokens, 64 out, $CONC clients at once"
bench random --num-requests "$NUM_RAND" --input-len 256 --output-len 64 --max-concurrency "$CONC" --json "$LOGS/random.json"
echo "logs: $LOGS"
