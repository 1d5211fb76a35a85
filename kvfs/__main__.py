"""`python -m kvfs` runs the command-line tool."""

import sys

from kvfs.cli import main

sys.exit(main())
