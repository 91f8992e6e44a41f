"""`python -m octavo.models [MODEL]`: prepare a model's cache directory now (the embedded default when
no MODEL is given), so that the first `octavo serve` does not spend its start on it."""

from __future__ import annotations

import logging
import sys

from octavo.models.loader import resolve_model


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model(argv[0] if argv else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
