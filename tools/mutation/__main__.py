"""`python -m tools.mutation [--check | --list | --only NAME ...]`: see tools/mutation/run.py."""

import sys

from tools.mutation.run import main

sys.exit(main())
