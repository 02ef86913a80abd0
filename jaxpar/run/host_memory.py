"""Keep freed host memory inside the process (glibc malloc), so XLA:CPU's step buffers are not
page-faulted in anew at every step.

Why: XLA:CPU mallocs an executable's temporaries at each execution and frees them at its end
(one block: 670 MB for the fp32 step of the L6/D384/T256/B8 benchmark config). glibc serves a
block that large with a fresh `mmap` (a thread's arena cannot grow past 64 MiB, and then
falls back to mmap even when M_MMAP_MAX is 0) and gives it back with `munmap`, so every step
first-touches ~164k new 4 KiB pages, a large share of the step's CPU time in the kernel
(benchmarks/README.md, profile_step.py). That is the cost the profile showed as
"zero fills of the scan's residual stacks": those are the first writes into the new block.

With one arena (M_ARENA_MAX=1), no mmap (M_MMAP_MAX=0) and no trimming (M_TRIM_THRESHOLD=-1,
mallopt(3)), large blocks come from the main heap and stay mapped after `free`, so the next
step reuses pages that are already there: 0 page faults per step. Costs: the process keeps
its peak heap (XLA needs that much again at the next step), and one arena serialises malloc
across threads (XLA:CPU mallocs a handful of buffers per step). Memory mapped by other means
(np.memmap of the token files, orbax) is not affected.

Must run before JAX starts its CPU client (its threads take an arena when they first
allocate); the CLI calls it next to the XLA flags. A no-op off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import platform

# mallopt parameter numbers from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks mapped (see the module docstring). Returns whether it applied."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    # mallopt returns 1 on success, 0 on error. Trim threshold -1: never (a finite one is at most
    # 2**31-1, which XLA's temporaries exceed once a few steps' buffers are in the heap)
    ok = [libc.mallopt(M_ARENA_MAX, 1), libc.mallopt(M_MMAP_MAX, 0), libc.mallopt(M_TRIM_THRESHOLD, -1)]
    return all(r == 1 for r in ok)
