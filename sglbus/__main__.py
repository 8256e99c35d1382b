"""`python -m sglbus ...`: the `sglbus` command (sglbus/cli.py)."""

import sys

from sglbus.cli import main

sys.exit(main())
