"""`python -m kvtier.cli ...` is the `kvtier` command."""

import sys

from kvtier.cli.main import main

sys.exit(main())
