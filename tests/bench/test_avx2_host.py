"""The AVX2-only host paths, on every host: the $JAXPAR_CPU_FLAGS seam of jaxpar.tolerances.cpu_flags()
and, in a subprocess under tests/avx2_host's emulation (XLA LLVM + YNNPACK + torch capped to AVX2),
one bf16 check within the AVX2 bounds. Reference: the bounds table (x BF16_HOST_FACTOR 2.0 without
native bf16) and the caps' own reports (XLA_FLAGS, YNNPACK's arch flags, torch's capability)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar import tolerances as T
from tests.avx2_host import avx2_only, emulation_env

ROOT = str(Path(__file__).parents[2])


def test_cpu_flags_seam_replaces_proc_cpuinfo(monkeypatch):
    monkeypatch.setenv("JAXPAR_CPU_FLAGS", "avx, avx2,,fma")
    assert T.cpu_flags() == {"avx", "avx2", "fma"}
    monkeypatch.setenv("JAXPAR_CPU_FLAGS", "")
    assert T.cpu_flags() == set()  # set but empty: a host with no flags, not /proc's
    monkeypatch.delenv("JAXPAR_CPU_FLAGS")
    assert T.cpu_flags() == T.proc_cpu_flags()


@pytest.mark.parametrize("flags, native", [("sse2,avx,avx2,fma,f16c", False), ("avx2,avx512f,avx512_bf16", True),
                                           ("avx2,amx_bf16", True), ("", False)])
def test_bf16_bounds_follow_the_seam(flags, native):
    code = "import json, jaxpar.tolerances as T; print(json.dumps([T.NATIVE_BF16, T.BF16_HOST_FACTOR, T.LOSS_RTOL_AMP]))"
    env = {**os.environ, "JAXPAR_CPU_FLAGS": flags, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    factor = 1.0 if native else 2.0
    assert json.loads(r.stdout) == [native, factor, T.TABLE["torchref.amp.loss"].value * factor]


def test_avx2_only_drops_avx512_and_amx():
    flags = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512vl", "amx_tile", "amx_bf16", "f16c"}
    assert avx2_only(flags) == ["avx", "avx2", "f16c", "fma", "sse2"]
    env = emulation_env({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(ROOT) / "tests" / "avx2_host"), "/x"]
    assert env["JAXPAR_CPU_FLAGS"] == ",".join(avx2_only(T.proc_cpu_flags()))


@pytest.mark.parametrize("flags, native", [("avx,avx2,fma", False), ("avx2,avx512f,avx512_bf16", True)])
def test_parity_report_labels_the_host_kind_the_bounds_were_picked_for(monkeypatch, flags, native):
    from parity_tests.report import host

    monkeypatch.setenv("JAXPAR_CPU_FLAGS", flags)
    h = host()
    assert h["native_bf16"] is native
    assert h["cpu_flags"] == {f: f in flags.split(",") for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                                 "amx_bf16", "avx512_fp16")}


def test_launcher_without_a_command_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "tests.avx2_host"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: no command given: python -m tests.avx2_host CMD [ARGS...]\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the YNNPACK cap reads /proc/self/maps")
def test_bf16_gpt2_tiny_within_the_avx2_bounds_under_emulation():
    """gpt2-tiny bf16 vs fp32 (loss, worst gradient tensor in l2, logits) on the emulated AVX2 host.
    Measured there (2-core AMD Zen 4, emulated): loss 1.02e-5, grad 6.93e-3, logits 3.76e-3 with bf16 x bf16
    dots; with the fp32-kernel form AVX2-only hosts now take: 1.08e-5, 6.95e-3, 4.34e-3."""
    env = emulation_env({**os.environ, "PYTHONPATH": ROOT})
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "tests.avx2_host.bf16_check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    # every cap took effect in the child
    assert got["native_bf16"] is False and got["bf16_host_factor"] == 2.0
    assert got["fp32_kernel_bf16_dots"] is True  # so the bf16 figures below are of the AVX2 hosts' dot form
    assert got["xla_flags"] == "--xla_cpu_max_isa=AVX2"
    detected, _, now = got["ynn_arch_flags"].partition("->")
    assert int(now, 16) == int(detected, 16) & 0x7F and int(now, 16) & ~0x7F == 0
    assert (got["torch_cpu_capability"], got["torch_mkldnn_bf16"]) == ("AVX2", False)
    # the AVX2 bounds: the table's values doubled (BF16_HOST_FACTOR), then the measured values
    assert got["bounds"] == {"loss_rel": 2 * T.TABLE["parity.bf16.loss"].value,
                             "grad_l2_rel": 2 * T.TABLE["parity.bf16.grad_l2"].value,
                             "logits_rel": 2 * T.TABLE["model.bf16.logits"].value}
    for k, bound in got["bounds"].items():
        assert 0 < got[k] <= bound, (k, got[k], bound)
