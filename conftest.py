"""Hypothesis profiles for the whole suite (tests/ and parity_tests/).

`ci` (default): every property test draws the same examples on every run (`derandomize`), so a
landing is never decided by a lucky draw and a failure reproduces from the commit alone.
`explore` (`HYPOTHESIS_PROFILE=explore python -m pytest ...`): fresh random draws each run, with
hypothesis' example database, to hunt for new counterexamples; pin what it finds with `@example`.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
