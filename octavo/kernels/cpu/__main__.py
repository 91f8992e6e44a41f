"""`python -m octavo.kernels.cpu`: build the C++ CPU kernels now (set-up runs it) rather than at first use."""

from __future__ import annotations

import logging
import sys

from octavo.kernels import cpu


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    module = cpu.load()
    if module is None:
        print("octavo: CPU kernels not built; the torch reference kernels will be used (slower)", file=sys.stderr)
    else:
        print(f"octavo: CPU kernels ready: {module.__file__}")
    return 0  # the engine runs without them, so set-up goes on either way


if __name__ == "__main__":
    sys.exit(main())
