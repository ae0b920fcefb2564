"""``python -m llamabatch``: the same command line as the ``llamabatch`` script."""

from __future__ import annotations

import sys

from llamabatch.cli import main

sys.exit(main())
