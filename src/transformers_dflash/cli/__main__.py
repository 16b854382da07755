"""`python -m transformers_dflash.cli`: the `dflash` command."""

import sys

from . import main

sys.exit(main())
