"""`octavo serve` whose model forward fails on demand, for the engine-death tests.

A forward whose input holds the token id POISON four times in a row (no real prompt here does)
writes the file $OCTAVO_FAULT_DIR/entered, waits (up to 30 s) for $OCTAVO_FAULT_DIR/release, then
raises: the test queues more requests while that step is stuck.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

POISON = 7777


def main() -> int:
    from octavo.cli import main as cli_main
    from octavo.models.llama import LlamaForCausalLM

    real_forward = LlamaForCausalLM.forward
    fault_dir = Path(os.environ["OCTAVO_FAULT_DIR"])

    def forward(self, input_ids, *args, **kwargs):
        ids = input_ids.tolist()
        if any(ids[i : i + 4] == [POISON] * 4 for i in range(len(ids) - 3)):
            (fault_dir / "entered").touch()
            deadline = time.monotonic() + 30
            while not (fault_dir / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("injected fault in the model forward")
        return real_forward(self, input_ids, *args, **kwargs)

    LlamaForCausalLM.forward = forward
    return cli_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
