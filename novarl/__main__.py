"""`python -m novarl ...`: the `novarl` command."""

import sys

from novarl.cli import main

sys.exit(main())
