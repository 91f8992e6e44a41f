#!/usr/bin/env bash
# The parsers' fuzz run: 10,000 hypothesis examples per tool-call and reasoning parser, streamed
# (random splits) and whole (tests/server/test_parsers.py; the suite runs 120 each). ~4 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OCTAVO_FUZZ_EXAMPLES="${1:-10000}" exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/server/test_parsers.py -k fuzz
