import sys

from torchref.cli import main

sys.exit(main())
