"""benchmarks/bf16_dot_form.py: each variant compiles the dot form it names, and bad flags are one error line."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bf16_dot_form  # noqa: E402

TINY = (1, 32, 2, 64, 16, 2)  # n_layer, n_embd, n_head, vocab, seq, batch


@pytest.mark.slow  # the benchmark script end to end (12 s)
def test_variants_compile_their_dot_forms_and_time_every_round():
    """Whatever the host: fp32 and fp32_kernel steps have fp32 dots only, bf16_kernel bf16 x bf16 -> fp32
    only (1 layer: 4 matmuls x 3 dots + 6 attention dots + the tied head's 3 = 21); the two bf16 forms'
    first losses agree to bf16 noise and differ from fp32's."""
    r = bf16_dot_form.measure("tiny", TINY, rounds=2)
    assert r["dots"] == {"fp32": {"f32 x f32 -> f32": 21}, "bf16_kernel": {"bf16 x bf16 -> f32": 21},
                         "fp32_kernel": {"f32 x f32 -> f32": 21}}
    assert set(r["cpu_median_s"]) == set(bf16_dot_form.VARIANTS) and all(t > 0 for t in r["cpu_median_s"].values())
    assert r["fp32_over_variant"]["fp32"] == 1.0
    l32, l16, lf = (r["losses"][v][0] for v in ("fp32", "bf16_kernel", "fp32_kernel"))
    assert abs(l16 - lf) <= 1e-3 * abs(l32) and l16 != l32


def test_bad_config_is_one_error_line():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bf16_dot_form.py"), "--configs", "small,nope"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: unknown --configs nope (known: small,mid,gpt2)\n"
