"""`python -m jtrainer.cli ...` (what `jtrainer launch` runs in each process)."""

import sys

from jtrainer.cli import main

sys.exit(main())
