"""`python -m octavo ...` runs the `octavo` command."""

import sys

from octavo.cli import main

sys.exit(main())
