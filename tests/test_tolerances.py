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


# Every exported bound and the table entry it must be; True: a bf16 bound, doubled off native bf16.
EXPORTS = {
    "SHARDED_VS_SINGLE.fp32.loss": ("sharded.fp32.loss", False), "SHARDED_VS_SINGLE.fp32.grad": ("sharded.fp32.grad", False),
    "SHARDED_VS_SINGLE.bf16.loss": ("sharded.bf16.loss", True), "SHARDED_VS_SINGLE.bf16.grad": ("sharded.bf16.grad", True),
    "PIPELINE_FORWARD": ("pipeline.fp32.forward", False),
    "CHUNKED_VS_PLAIN.loss": ("chunked.fp32.loss", False), "CHUNKED_VS_PLAIN.grad": ("chunked.fp32.grad", False),
    "CHUNKED_BF16_GRAD_L2": ("chunked.bf16.grad_l2", True), "KNOBS_BF16_GRAD_L2": ("knobs.bf16.grad_l2", True),
    "FP32_DOTS_VS_PLAIN.loss": ("fp32_dots.loss", False), "FP32_DOTS_VS_PLAIN.grad": ("fp32_dots.grad", False),
    "CAUSAL_BLOCKS_VS_UNBLOCKED": ("causal_blocks.fp32.grad", False),
    "FLAX_MODEL_SHARDED_VS_SINGLE.loss": ("flax_model.fp32.loss", False),
    "FLAX_MODEL_SHARDED_VS_SINGLE.grad": ("flax_model.fp32.grad", False),
    "MULTIPROCESS_VS_SINGLE.loss": ("multiprocess.fp32.loss", False),
    "MULTIPROCESS_VS_SINGLE.grad_norm": ("multiprocess.fp32.grad_norm", False),
    "BF16_LOGITS_REL": ("model.bf16.logits", True),
    "LOSS_RTOL_FP32": ("torchref.fp32.loss", False), "GRAD_TOL_FP32": ("torchref.fp32.grad", False),
    "LOSS_RTOL_AMP": ("torchref.amp.loss", True), "LOSS_RTOL_FP16_WIRE": ("torchref.fp16wire.loss", False),
    "GRAD_NORM_RTOL_AMP": ("torchref.amp.grad_l2", True),
    "MODEL.logits_abs": ("parity.model.logits_abs", False), "MODEL.loss_rel": ("parity.model.loss", False),
    "MODEL.grad_rel": ("parity.model.grad", False), "MODEL.update_rel": ("parity.model.update", False),
    "TRAJECTORY.fp32.loss_rel": ("parity.fp32.loss", False), "TRAJECTORY.fp32.grad_rel": ("parity.fp32.grad", False),
    "TRAJECTORY.bf16.loss_rel": ("parity.bf16.loss", True), "TRAJECTORY.bf16.grad_l2_rel": ("parity.bf16.grad_l2", True),
}
_EXPORTS_PROBE = """import json, jaxpar.tolerances as T
def flat(name, v):
    return {f"{name}.{k}": x for k2, v2 in v.items() for k, x in flat(k2, v2).items()} if isinstance(v, dict) else {name: v}
out = {}
for n in ("SHARDED_VS_SINGLE", "PIPELINE_FORWARD", "CHUNKED_VS_PLAIN", "CHUNKED_BF16_GRAD_L2", "KNOBS_BF16_GRAD_L2",
          "FP32_DOTS_VS_PLAIN", "CAUSAL_BLOCKS_VS_UNBLOCKED", "FLAX_MODEL_SHARDED_VS_SINGLE", "MULTIPROCESS_VS_SINGLE",
          "BF16_LOGITS_REL", "LOSS_RTOL_FP32", "GRAD_TOL_FP32", "LOSS_RTOL_AMP", "LOSS_RTOL_FP16_WIRE",
          "GRAD_NORM_RTOL_AMP", "MODEL", "TRAJECTORY"):
    out.update({k.split(".", 1)[1]: v for k, v in flat("_", {n: getattr(T, n)}).items()})
print(json.dumps(out))
"""


def test_every_exported_bound_is_its_table_entry_doubled_for_bf16_off_native_hosts():
    """Each name the tests import is the table entry its name says (no other entry's value), and on a
    host without native bf16 (the JAXPAR_CPU_FLAGS seam, as tests/avx2_host sets it) exactly the bf16
    ones are doubled. Two fresh interpreters: the factor is fixed at import."""
    import os

    for flags, factor in (("avx,avx2,fma", 2.0), ("avx2,avx512f,avx512_bf16", 1.0)):
        r = subprocess.run([sys.executable, "-c", _EXPORTS_PROBE], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "JAXPAR_CPU_FLAGS": flags})
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got == {k: T.TABLE[e].value * (factor if bf16 else 1.0) for k, (e, bf16) in EXPORTS.items()}, flags
