"""`python -m tests.avx2_host CMD [ARGS...]`: run CMD on an emulated AVX2-only host (see __init__)."""

import os
import sys

from tests.avx2_host import emulation_env

if len(sys.argv) < 2:
    print("error: no command given: python -m tests.avx2_host CMD [ARGS...]", file=sys.stderr)
    sys.exit(2)
os.execvpe(sys.argv[1], sys.argv[1:], emulation_env())
