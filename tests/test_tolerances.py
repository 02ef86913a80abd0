"""The tolerance table (jaxpar/tolerances.py): one module, free of jax and torch, every bound
within 4x of the value measured on this host kind. Reference: the measured values written in the
table (from the runs named beside them) and the import graph of a fresh interpreter."""

import json
import subprocess
import sys

from jaxpar import tolerances as T


def test_every_bound_is_at_least_measured_and_at_most_4x_it():
    assert len(T.TABLE) >= 20
    too_loose = {k: round(b.value / b.measured, 1) for k, b in T.TABLE.items() if b.value > 4 * b.measured}
    too_tight = {k: (b.value, b.measured) for k, b in T.TABLE.items() if not b.value >= b.measured >= 0}
    assert not too_loose, f"bounds over 4x their measured value (re-measure, do not loosen): {too_loose}"
    assert not too_tight, f"bounds below their measured value: {too_tight}"
    assert [k for k, b in T.TABLE.items() if len(b.why) < 30] == []  # every bound says where it comes from


def test_one_module_free_of_jax_and_torch():
    code = ("import sys, json; import jaxpar.tolerances, parity_tests.tolerances as p; "
            "print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'torch', 'jaxlib')), "
            "p.TRAJECTORY is jaxpar.tolerances.TRAJECTORY]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [[], True]


def test_bf16_bounds_tighten_on_native_bf16_hosts():
    flags = T.cpu_flags()  # /proc/cpuinfo's, or $JAXPAR_CPU_FLAGS on an emulated host (tests/avx2_host)
    assert T.NATIVE_BF16 == ("avx512_bf16" in flags or "amx_bf16" in flags)
    assert T.BF16_HOST_FACTOR == (1.0 if T.NATIVE_BF16 else 2.0)
    assert T.LOSS_RTOL_AMP == T.U_BF16 / 16 * T.BF16_HOST_FACTOR  # U_BF16 / sqrt(B*T), B*T = 256
    assert T.LOSS_RTOL_FP32 == T.TABLE["torchref.fp32.loss"].value  # fp32 bounds do not depend on the host


def test_cpuinfo_readers_take_the_first_cpus_model_name_and_flags_lines():
    """Reference: the lines matched by a regex here (model name, not the numeric `model` before it)."""
    import os
    import re

    if not os.path.exists("/proc/cpuinfo"):
        assert (T.cpu_model(), T.proc_cpu_flags()) == ("", set())
        return
    text = open("/proc/cpuinfo").read()
    model = re.search(r"^model name\s*:\s*(.*?)\s*$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*?)\s*$", text, re.M)
    assert T.cpu_model() == (model[1] if model else "")
    assert T.proc_cpu_flags() == (set(flags[1].split()) if flags else set())
