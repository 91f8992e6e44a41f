#!/usr/bin/env bash
# Octavo vs llama.cpp's llama-server, same GGUF, same requests, one machine, side by side:
#   1. one user at a time: 8 requests of 128 tokens in / 128 out, concurrency 1;
#   2. concurrency 16 on ../shared/workloads/random_n64.json.
# Each load runs on both servers in turn, 3 rounds (fresh prompts each round), medians + ratios.
#   tools/compare_llama_cpp.sh                    # after `make setup`; builds llama-server once (~10-20 min)
#   MODEL=gemma3-270m tools/compare_llama_cpp.sh  # the same on Gemma 3 270M's Q4_K_M file
# Env: OUT (results dir, default bench-results), ROUNDS (default 3), OCTAVO_FLAGS (extra serve flags),
#      WORKLOAD (default ../shared/workloads/random_n64.json), MODEL (a packaged model name or a
#      .gguf path; default the embedded SmolLM2), LOADS (default one_user,concurrency16; also usersN:
#      N users at once on random requests of ONE_USER_LEN in / ONE_USER_OUT out, 2N of them, e.g. users4),
#      ONE_USER_REQUESTS, ONE_USER_LEN (default 8 and 128: the one-user load's requests and lengths),
#      ONE_USER_OUT (its output length, default ONE_USER_LEN: e.g. ONE_USER_LEN=512 ONE_USER_OUT=16 for TTFT),
#      SLOT_CTX (llama-server's context per slot, default 1024; 4096 for ONE_USER_LEN=2048),
#      PERPLEXITY=1 (after the loads: `octavo eval` of int8 against float32 and llama-perplexity on the
#      same text, windows of 512, the servers stopped first; then llama.cpp's KL divergence from
#      Octavo's exact log-probabilities, `octavo eval --kl-base`). LOADS=none runs only that.
#      KV_DTYPE (both sides' KV cache at one format: float32, float16, bfloat16 or int8, as Octavo's
#      --kv-cache-dtype and llama.cpp's -ctk/-ctv f32, f16, bf16, q8_0, with -fa on; default: each
#      server's own default, llama.cpp's f16 and Octavo's auto),
#      OCTAVO_ADAPTIVE_THREADS (default 0 here: Octavo keeps its 2 threads, as llama-server keeps its -t;
#      the adaptive policy would drop to 1 while the other server spins up, and time that instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-bench-results}
ROUNDS=${ROUNDS:-3}
WORKLOAD=${WORKLOAD:-../shared/workloads/random_n64.json}
LOADS=${LOADS:-one_user,concurrency16}
ONE_USER_REQUESTS=${ONE_USER_REQUESTS:-8}
ONE_USER_LEN=${ONE_USER_LEN:-128}
ONE_USER_OUT=${ONE_USER_OUT:-$ONE_USER_LEN}
mkdir -p "$OUT"
LLAMA=$(tools/build_llama_server.sh)
MODEL=${MODEL:-}
GGUF=$($PY -c "
import sys
from pathlib import Path
from octavo.models.loader import PACKAGED_MODELS, default_gguf_path, packaged_gguf
m = sys.argv[1]
print(default_gguf_path() if not m else packaged_gguf(m) if m in PACKAGED_MODELS else Path(m).resolve())" "$MODEL")
THREADS=$(nproc)

# 16 slots of SLOT_CTX tokens (default 1,024: the longest request of random_n64 is 744, prompt + output;
# SLOT_CTX=4096 for ONE_USER_LEN=2048).
SLOT_CTX=${SLOT_CTX:-1024}
KV_DTYPE=${KV_DTYPE:-}
LLAMA_KV=() OCTAVO_KV=()
if [[ -n "$KV_DTYPE" ]]; then
  case "$KV_DTYPE" in
    float32) ggml=f32 ;; float16) ggml=f16 ;; bfloat16) ggml=bf16 ;; int8) ggml=q8_0 ;;
    *) echo "KV_DTYPE must be float32, float16, bfloat16 or int8, not $KV_DTYPE" >&2; exit 2 ;;
  esac
  LLAMA_KV=(-ctk "$ggml" -ctv "$ggml" -fa on) OCTAVO_KV=(--kv-cache-dtype "$KV_DTYPE")
fi
"$LLAMA" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np 16 -c $((16 * SLOT_CTX)) "${LLAMA_KV[@]}" --host 127.0.0.1 --port 8091 \
  >"$OUT/llama-server.log" 2>&1 &
LLAMA_PID=$!
OCTAVO_ADAPTIVE_THREADS=${OCTAVO_ADAPTIVE_THREADS:-0} OMP_NUM_THREADS=$THREADS .venv/bin/octavo serve ${MODEL:+"$GGUF"} --port 8090 \
  "${OCTAVO_KV[@]}" ${OCTAVO_FLAGS:-} >"$OUT/octavo-serve.log" 2>&1 &
OCTAVO_PID=$!
trap 'kill $LLAMA_PID $OCTAVO_PID 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for url in http://127.0.0.1:8090/health http://127.0.0.1:8091/health; do
  for _ in $(seq 1 300); do curl -fs "$url" >/dev/null 2>&1 && break; sleep 1; done
  curl -fs "$url" >/dev/null || { echo "server at $url did not come up (logs in $OUT)" >&2; exit 1; }
done
grep -h "weights:\|KV cache: " "$OUT/octavo-serve.log" || true

BENCH=(.venv/bin/octavo bench serve --base-url http://127.0.0.1:8090 --compare http://127.0.0.1:8091
       --labels octavo,llama.cpp --repeats "$ROUNDS")
if [[ ",$LOADS," == *",one_user,"* ]]; then
  echo "## one user at a time: $ONE_USER_REQUESTS requests, $ONE_USER_LEN in / $ONE_USER_OUT out, concurrency 1"
  # (a load with failed requests exits 1; report it and go on to the next load)
  "${BENCH[@]}" random --num-requests "$ONE_USER_REQUESTS" --input-len "$ONE_USER_LEN" --output-len "$ONE_USER_OUT" \
    --max-concurrency 1 --json "$OUT/one_user.json" || status=1
  echo
fi
for load in ${LOADS//,/ }; do
  [[ $load =~ ^users([0-9]+)$ ]] || continue
  users=${BASH_REMATCH[1]}
  echo "## $users users at once: $((2 * users)) requests, $ONE_USER_LEN in / $ONE_USER_OUT out, concurrency $users"
  "${BENCH[@]}" random --num-requests $((2 * users)) --input-len "$ONE_USER_LEN" --output-len "$ONE_USER_OUT" \
    --max-concurrency "$users" --json "$OUT/$load.json" || status=1
  echo
done
if [[ ",$LOADS," == *",concurrency16,"* ]]; then
  echo "## concurrency 16: $WORKLOAD"
  "${BENCH[@]}" replay "$WORKLOAD" --max-concurrency 16 --json "$OUT/concurrency16.json" || status=1
fi
if [[ "${PERPLEXITY:-0}" == 1 ]]; then
  kill $LLAMA_PID $OCTAVO_PID 2>/dev/null || true; wait 2>/dev/null || true
  TEXT=octavo/bench/data/eval_text.txt
  echo "## accuracy on $TEXT (windows of 512, second halves scored)"
  OMP_NUM_THREADS=$THREADS .venv/bin/octavo eval ${MODEL:+"$GGUF"} --modes int8 --json "$OUT/eval.json" \
    --kl-base "$OUT/exact.kld" 2>"$OUT/eval.log" || status=1
  # llama-perplexity's own figure on the same file and text (its tokenizer's BOS per window)
  "$(dirname "$LLAMA")/llama-perplexity" -m "$GGUF" -f "$TEXT" -c 512 -b 512 -t "$THREADS" >"$OUT/llama-perplexity.log" 2>&1 \
    || status=1
  grep -h "Final estimate" "$OUT/llama-perplexity.log" | sed 's/^/llama.cpp (Q8 activations): /' || true
  # llama.cpp's logits against Octavo's exact ones, same tokens (KL divergence, same top token)
  "$(dirname "$LLAMA")/llama-perplexity" -m "$GGUF" --kl-divergence-base "$OUT/exact.kld" --kl-divergence -c 512 -b 512 \
    -t "$THREADS" >"$OUT/llama-kl.log" 2>&1 || status=1
  grep -hE "^(Mean PPL\(Q\) |Mean PPL\(base\)|Mean +KLD|Maximum KLD|Same top p)" "$OUT/llama-kl.log" \
    | sed 's/^/llama.cpp vs exact: /' || true
  rm -f "$OUT/exact.kld"  # (2 bytes per vocabulary entry per scored token: 400 MB for Gemma's)
fi
exit "${status:-0}"
