"""benchmarks/gpu_levers.py without a GPU: each lever's command line and XLA flags, the sweep's order,
ratios and budget with a stand-in for the measuring process, and a real lever process refused on CPU."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_levers  # noqa: E402
import gpu_mfu  # noqa: E402

from jaxpar.run import xla_flags  # noqa: E402


def test_a_levers_flag_wins_over_jaxpars_gpu_default():
    env = gpu_levers.lever_env("triton_gemm", {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false --foo=1", "A": "b"})
    assert env == {"XLA_FLAGS": "--foo=1 --xla_gpu_enable_triton_gemm=true", "A": "b"}
    # what gpu_mfu.py's start_gpu then applies: the defaults, less the one the lever set
    applied = xla_flags.with_gpu_defaults(env["XLA_FLAGS"]).split()
    assert [f for f in applied if "triton_gemm" in f] == ["--xla_gpu_enable_triton_gemm=true"]
    assert len(applied) == len(xla_flags.GPU_FLAGS) + 1
    off = gpu_levers.lever_env("no_overlap", {})["XLA_FLAGS"].split()
    assert off == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_gpu_enable_highest_priority_async_stream=false",
                   "--xla_gpu_enable_pipelined_all_gather=false", "--xla_gpu_enable_pipelined_reduce_scatter=false",
                   "--xla_gpu_enable_pipelined_all_reduce=false", "--xla_gpu_enable_while_loop_double_buffering=false"]
    assert gpu_levers.lever_env("base", {"XLA_FLAGS": "--foo=1"}) == {"XLA_FLAGS": "--foo=1"}


def test_each_lever_is_one_gpu_mfu_command():
    args = gpu_levers.parse_args(["--batch", "8", "--steps", "5"])
    tail = ["--seq", "1024", "--steps", "5", "--warmup", "2", "--out", "o.json"]
    script = os.path.join(ROOT, "benchmarks", "gpu_mfu.py")
    assert gpu_levers.command("batch2x", args, "o.json") == [
        sys.executable, script, "--torch", "off", "--models", "gpt2-medium", "--batch", "16", *tail]
    assert gpu_levers.command("vocab_chunks4", args, "o.json")[6:] == ["--batch", "8", *tail, "--vocab-chunks", "4"]
    # and gpu_mfu.py takes what the levers pass
    parsed = gpu_mfu.parse_args(gpu_levers.command("remat_selective", args, "o.json")[2:])
    assert (parsed.remat, parsed.vocab_chunks, parsed.torch) == ("selective", 1, "off")


def test_an_unknown_lever_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_levers.main(["--levers", "base,fast,cublaslt,turbo"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: --levers fast,turbo: no such lever (levers: base, cublaslt, triton_gemm, no_overlap, no_cuda_graphs, "
        "vocab_chunks4, remat_selective, batch2x)\n")


def test_the_sweep_runs_base_first_and_last_within_its_budget(capsys):
    """Stand-in levers of known length on a stand-in clock (base 40 s, cublaslt 30, triton_gemm 50 and
    failing, batch2x 20): a lever starts only while the budget left is at least the slowest so far."""
    now = [0.0]
    spent = {"base": 40.0, "cublaslt": 30.0, "triton_gemm": 50.0, "batch2x": 20.0}
    mfu = {"base": 0.40, "cublaslt": 0.42, "batch2x": 0.44}
    calls = []

    def run(lever, args, timeout):
        calls.append((lever, timeout))
        now[0] += spent[lever]
        row = {"lever": lever, "seconds": spent[lever]}
        if lever == "triton_gemm":
            return {**row, "error": "Unknown flags in XLA_FLAGS: --xla_gpu_enable_triton_gemm=true"}
        return {**row, "batch": 8, "median_step_s": 0.05, "mfu": mfu[lever]}

    args = gpu_levers.parse_args(["--levers", "cublaslt,triton_gemm,batch2x", "--budget", "200"])
    rows = gpu_levers.sweep(args, run=run, clock=lambda: now[0])
    # left before each: 200, 160, 130, 80 (>= 50: run), then 60 (>= 50: base runs again)
    assert calls == [("base", 200.0), ("cublaslt", 160.0), ("triton_gemm", 130.0), ("batch2x", 80.0), ("base", 60.0)]
    assert [r["lever"] for r in rows] == ["base", "cublaslt", "triton_gemm", "batch2x", "base"]
    assert [r.get("vs_base") for r in rows] == [1.0, pytest.approx(1.05), None, pytest.approx(1.1), 1.0]
    out = capsys.readouterr().out
    assert "triton_gemm      failed: Unknown flags in XLA_FLAGS: --xla_gpu_enable_triton_gemm=true" in out
    # a tighter budget: after base and cublaslt 30 s are left, below the slowest (40 s)
    now[0], calls[:] = 0.0, []
    rows = gpu_levers.sweep(gpu_levers.parse_args(["--levers", "cublaslt,batch2x", "--budget", "100"]), run=run,
                            clock=lambda: now[0])
    assert [c[0] for c in calls] == ["base", "cublaslt"]
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "batch2x: not run (30 s of the budget left, the slowest lever took 40 s)",
        "base: not run (30 s of the budget left, the slowest lever took 40 s)"]


def test_a_lever_whose_process_fails_is_a_row_with_its_error_line(monkeypatch):
    """The real run_one on CPU: gpu_mfu.py refuses (no GPU), and the row carries its line."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    row = gpu_levers.run_one("cublaslt", gpu_levers.parse_args([]), timeout=120)
    assert row["lever"] == "cublaslt" and 0 < row["seconds"] < 120
    assert row["error"] == ("error: gpu_mfu.py measures GPU MFU and needs an NVIDIA GPU (none here: no /dev/nvidia*, "
                            "no nvidia-smi, or JAX_PLATFORMS='cpu')")


def test_gpu_mfu_builds_the_step_with_the_levers_train_settings():
    cfg, trainer, *_ = gpu_mfu.preset_step("gpt2-tiny", 2, 16, remat="selective", vocab_chunks=4)
    assert (cfg.train.remat, cfg.train.vocab_chunks, cfg.precision) == ("selective", 4, "bf16")
