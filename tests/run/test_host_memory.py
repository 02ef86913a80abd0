"""jaxpar.run.host_memory: with it, XLA:CPU's per-execution buffers stop being page-faulted in anew
at every call (without it, page faults cost a mid-config fp32 step a large share of its time).

Each case is its own process (the malloc settings are process-wide and must precede JAX's CPU
client). The probe's (8192, 4096) fp32 matmul output (128 MiB) is a temporary of the executable;
first-touching it costs 32768 minor faults of 4 KiB, which the baseline process must show, so
the probe cannot pass by having no large temporary.

Pages are the kernel's base pages in every case: the probe turns transparent huge pages off for
itself (prctl PR_SET_THP_DISABLE) and runs without the environment's malloc tunables. Where THP is
`always` (the default of several distributions; here it is `madvise`), a 128 MiB mapping faults in
as 64 huge pages, not 32768 base pages, and the baseline below would read 756 faults in 10 calls
(measured here by having glibc advise huge pages: GLIBC_TUNABLES=glibc.malloc.hugetlb=1)."""

from __future__ import annotations

import mmap
import subprocess
import sys

import pytest
from support.cli_helpers import clean_env

MALLINFO2 = """
import ctypes, mmap
class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t counters
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = MallInfo2, ctypes.c_void_p
"""

PROBE = MALLINFO2 + """
import resource, sys
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
assert libc.prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE: base pages only, whatever the host's THP mode
if sys.argv[1] == "keep":
    from jaxpar.run.host_memory import keep_freed_memory
    assert keep_freed_memory()
import jax, jax.numpy as jnp
# a @ b: a (8192, 4096) fp32 temporary, 128 MiB. The barrier keeps it: jax 0.12's XLA:CPU fuses a dot, sin and
# sum into one YNNPACK fusion with no temporary at all (then nothing is malloc'd and nothing faults)
f = jax.jit(lambda a, b: jnp.sin(jax.lax.optimization_barrier(a @ b)).sum())
a, b = jnp.ones((8192, 8)), jnp.ones((8, 4096))
assert f.lower(a, b).compile().memory_analysis().temp_size_in_bytes >= 8192 * 4096 * 4
for _ in range(2):
    f(a, b).block_until_ready()
arena0, faults0 = libc.mallinfo2().arena, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(CALLS):
    f(a, b).block_until_ready()
# heap growth in base pages, page faults
print((libc.mallinfo2().arena - arena0) // mmap.PAGESIZE, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0)
"""
CALLS = 10
PAGES = 8192 * 4096 * 4 // mmap.PAGESIZE  # the temporary's base pages: 32768 of 4 KiB


def probe_env() -> dict:
    """The probes compare glibc's own malloc defaults with jaxpar's: no malloc tunables from the
    environment (GLIBC_TUNABLES, MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, ...)."""
    return {k: v for k, v in clean_env().items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}


def faults_and_growth(mode: str) -> tuple[int, int]:
    """(minor page faults, pages the main malloc heap grew by) over CALLS calls after 2 warm-up calls,
    in a fresh process."""
    r = subprocess.run([sys.executable, "-c", PROBE.replace("CALLS", str(CALLS)), mode], env=probe_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    growth, faults = map(int, r.stdout.split())
    return faults, growth


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings")
def test_freed_buffers_stay_mapped_so_repeat_calls_do_not_page_fault():
    """The claim is that no page is faulted in twice: every fault is a page the heap grew by.

    Not "no fault after warm-up": XLA frees a call's temporaries on its own threads, after the result
    is ready, so on a loaded host several calls' temporaries are alive at once and the heap keeps
    growing for a while (seen: up to 6 blocks in 20 calls at load 3; one CI run failed a per-call
    bound that way). Each growth faults its new pages in once; none is given back."""
    faults, growth = faults_and_growth("default")
    # without: every call maps the temporary afresh (mmap), the heap does not hold it
    assert faults >= CALLS * PAGES and growth < PAGES
    faults, growth = faults_and_growth("keep")
    # with: the faults are the heap's growth (a few stray pages per call allowed; measured 0-3)
    assert faults - growth < 100 * CALLS, (faults, growth)


CLI_PROBE = MALLINFO2 + """
import sys
from jax._src import xla_bridge
from jaxpar import cli
from jaxpar.run import host_memory
applied = []  # (returned, JAX backends already up) per call
keep = host_memory.keep_freed_memory
host_memory.keep_freed_memory = lambda: applied.append((keep(), xla_bridge.backends_are_initialized())) or True
if sys.argv[1] == "cli":
    assert cli.main(["mesh"]) == 0
else:
    import jax
    jax.devices()
assert xla_bridge.backends_are_initialized()
mapped = libc.mallinfo2().hblkhd  # bytes of blocks malloc serves with their own mmap
block = libc.malloc(64 << 20)
print(applied, libc.mallinfo2().hblkhd - mapped, file=sys.stderr)
libc.free(ctypes.c_void_p(block))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings")
def test_the_cli_applies_the_settings_before_jax_starts():
    """README (Host memory): `jaxpar <command>` makes malloc keep freed blocks mapped before JAX
    starts. Seen from outside the module: after `jaxpar mesh` (in-process, as the entry point
    runs it), a 64 MiB malloc comes from the heap (no mmap'd bytes added); without the CLI
    (baseline), glibc mmaps it. The settings were applied once, before any JAX backend existed."""
    def probe(mode: str) -> str:
        r = subprocess.run([sys.executable, "-c", CLI_PROBE, mode], env=probe_env(), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stderr.strip().splitlines()[-1]

    applied, mapped = probe("plain").split("] ")
    assert applied == "[" and (64 << 20) <= int(mapped) <= (64 << 20) + 65536  # the block + its header page
    assert probe("cli") == "[(True, False)] 0"
