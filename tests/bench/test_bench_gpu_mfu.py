"""benchmarks/gpu_mfu.py, gpu_check.py and gpu_profile.py refuse on a machine without a GPU: one
line, exit 2, nothing written (gpu_mfu.start_gpu, shared); gpu_profile.py's trace reader on a
synthetic Chrome-format trace."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_mfu  # noqa: E402
import gpu_profile  # noqa: E402

WHAT = {"gpu_mfu.py": "measures GPU MFU", "gpu_check.py": "compares the GPU attention paths",
        "gpu_profile.py": "profiles the GPU step", "gpu_levers.py": "sweeps the GPU speed levers"}


@pytest.mark.parametrize("script", sorted(WHAT))
def test_refuses_on_cpu(tmp_path, script):
    out = tmp_path / "out.json"
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {script} {WHAT[script]} and needs an NVIDIA GPU (none here: no /dev/nvidia*, no nvidia-smi, "
        "or JAX_PLATFORMS='cpu')"]
    assert r.stdout == "" and not out.exists()


def test_refuses_where_jax_sees_no_gpu(monkeypatch, capsys):
    """A machine with an NVIDIA device that JAX does not use (no CUDA plugin, say): the second check."""
    monkeypatch.setattr(gpu_mfu.xla_flags, "has_nvidia_gpu", lambda *a: True)
    monkeypatch.setenv("XLA_FLAGS", "")  # apply_gpu_defaults writes it; restored after the test
    assert gpu_mfu.start_gpu("gpu_x.py", "does X") is False
    assert capsys.readouterr().err.splitlines() == [
        "error: gpu_x.py does X and needs a GPU (jax backend: cpu, devices: cpu)"]


def _meta(kind, pid, name, tid=None):
    return {"ph": "M", "name": kind, "pid": pid, **({} if tid is None else {"tid": tid}), "args": {"name": name}}


def _x(pid, tid, ts, dur, name, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


TRACE = {"traceEvents": [
    _meta("process_name", 1, "/device:GPU:0"), _meta("thread_name", 1, "Stream #14(Compute)", 7),
    _meta("thread_name", 1, "XLA Ops", 8), _meta("process_name", 2, "/host:CPU"),  # XLA Ops: not kernels
    _meta("thread_name", 2, "python", 9),
    # 2 steps: a gemm overlapping a fusion (union 1500 us), then attention and a copy after a gap
    _x(1, 7, 0, 1000, "nvjet_sm90_tst_128x128_NNT", hlo_op="custom-call.3"), _x(1, 7, 500, 1000, "loop_add_fusion"),
    _x(1, 7, 3000, 2000, "cudnn_generated_fort_native_sdpa_sm90_flash_bprop"), _x(1, 7, 6000, 400, "memcpy128"),
    _x(1, 8, 0, 1500, "fusion.1", long_name="fusion.1 = bf16[8] fusion(p0)"),
    _x(2, 9, 0, 99999, "host work"),  # not a device event
    {"ph": "i", "pid": 1, "tid": 7, "ts": 10, "name": "instant"},  # no duration
]}


def test_trace_reader_sums_device_kernels_per_step():
    threads = gpu_profile.device_threads(TRACE)
    assert threads == {(1, 7): "Stream #14(Compute)", (1, 8): "XLA Ops"}
    k = gpu_profile.summarize(gpu_profile.complete_events(TRACE, threads, "Stream"), steps=2)
    assert k["busy_ms"] == (1500 + 2000 + 400) / 1e3 / 2  # overlap counted once
    assert k["by_class_ms"] == {"attention": 1.0, "matmul": 0.5, "other": 0.5, "copy": 0.2}
    assert k["events_per_step"] == 2.0
    # by HLO instruction: the library kernel under the custom-call the trace names, the rest by name
    assert gpu_profile.times_by_op(gpu_profile.complete_events(TRACE, threads, "Stream"), steps=2) == {
        "custom-call.3": 0.5, "loop_add_fusion": 0.5, "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 1.0,
        "memcpy128": 0.2}
    assert [gpu_profile.hbm_tbps(k) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "Tesla T4")] \
        == [3.35, 2.0, 4.8, None]


def test_measure_times_steps_after_warmup_and_derives_mfu_from_the_median(monkeypatch):
    """gpu_mfu.measure with a stand-in step (no GPU, no compile): --steps timed steps after --warmup
    untimed ones; tokens/s and MFU from the median step, the run's FLOPs/token and the device peak."""
    import statistics
    from types import SimpleNamespace

    from jaxpar import train
    from jaxpar.config import PRESETS, Config, TrainConfig

    calls = []
    cfg = Config(model=PRESETS["gpt2-tiny"], train=TrainConfig(batch_size=2, seq_len=16), precision="bf16")
    trainer = SimpleNamespace(step_fn=lambda s, x, y: calls.append(s) or (s + 1, {"loss": 1.0}))
    monkeypatch.setattr(gpu_mfu, "preset_step", lambda *a: (cfg, trainer, 0, None, None))
    monkeypatch.setattr(train, "device_peak_flops", lambda c: 1e12)
    r = gpu_mfu.measure("gpt2-tiny", 2, gpu_mfu.parse_args(["--steps", "4", "--warmup", "2", "--seq", "16"]))
    assert calls == list(range(6)) and len(r["times_s"]) == 4
    med = statistics.median(r["times_s"])
    assert (r["median_step_s"], r["tokens_per_s"]) == (med, 32 / med)
    flops = PRESETS["gpt2-tiny"].flops_per_token(16) * 32 / med
    assert (r["tflops_per_s"], r["peak_tflops"], r["mfu"]) == (flops / 1e12, 1.0, flops / 1e12)


# ----------------------------------------------------------------------------- the PyTorch peer, side by side

def test_torch_peer_is_jaxpars_shape_and_times_like_gpu_mfu():
    """benchmarks/torch_peer.py on CPU at gpt2-tiny B2 T16 (eager): exactly ModelConfig.num_params()
    parameters (so jaxpar's FLOPs per token apply), --steps timed steps after --warmup, rates from the
    median, and a first loss at ln(vocab) (GPT-2's init)."""
    import math
    import statistics

    import torch
    import torch_peer

    from jaxpar.config import PRESETS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite's workers share the cores
    try:
        r = torch_peer.measure("gpt2-tiny", 2, 16, steps=2, warmup=1, compile_=False, device="cpu", peak_flops=1e12)
    finally:
        torch.set_num_threads(threads)
    mc = PRESETS["gpt2-tiny"]
    assert r["params"] == mc.num_params() == 462_336
    assert len(r["times_s"]) == 2 and len(r["losses"]) == 3
    med = statistics.median(r["times_s"])
    assert (r["median_step_s"], r["tokens_per_s"], r["mfu"]) == (med, 32 / med, mc.flops_per_token(16) * 32 / med / 1e12)
    assert abs(r["losses"][0] - math.log(256)) < 0.1


def test_side_by_side_runs_the_peer_first_and_writes_the_speedup(monkeypatch, tmp_path, capsys):
    """gpu_mfu.main with the GPU checks and both steps stood in (their timing is the tests above):
    the peer runs on every shape before JAX starts; the JSON holds both rows and one side_by_side
    entry per shape, speedup = torch ms / jaxpar ms, the torch MFU recomputed at jaxpar's peak."""
    import json

    import torch_peer

    from jaxpar.config import PRESETS

    order = []
    jax_ms, torch_ms = {"gpt2": 40.0, "gpt2-medium": 50.0}, {"gpt2": 38.0, "gpt2-medium": 60.0}

    def jax_row(model, batch, args):
        order.append(("jax", model))
        med = jax_ms[model] / 1e3
        return {"model": model, "batch": batch, "seq": args.seq, "median_step_s": med,
                **torch_peer.rates(PRESETS[model], batch, args.seq, med, 989e12)}

    def torch_row(model, batch, seq, steps, warmup, compile_, device, peak):
        order.append(("torch", model, compile_))
        return {"model": model, "batch": batch, "seq": seq, "compile": compile_, "median_step_s": torch_ms[model] / 1e3,
                "warmup_s": 1.0, "mfu": peak}  # nan: filled in at jaxpar's peak

    monkeypatch.setattr(torch_peer, "measure", torch_row)
    monkeypatch.setattr(torch_peer.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_peer.torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    monkeypatch.setattr(gpu_mfu, "measure", jax_row)
    monkeypatch.setattr(gpu_mfu.xla_flags, "has_nvidia_gpu", lambda *a: True)
    monkeypatch.setattr(gpu_mfu, "start_gpu", lambda *a: order.append("start jax") or True)
    out = tmp_path / "mfu.json"
    assert gpu_mfu.main(["--seq", "1024", "--out", str(out)]) == 0
    assert order == [("torch", "gpt2", True), ("torch", "gpt2-medium", True), "empty_cache", "start jax",
                     ("jax", "gpt2"), ("jax", "gpt2-medium")]
    rep = json.loads(out.read_text())
    assert [(r["model"], r["batch"]) for r in rep["rows"]] == [("gpt2", 16), ("gpt2-medium", 8)]
    s124, s350 = rep["side_by_side"]
    assert (s124["speedup"], s350["speedup"]) == (0.038 / 0.040, 0.060 / 0.050)
    assert (s350["jaxpar_ms"], s350["torch_ms"], s350["torch_compile"]) == (50.0, 60.0, True)
    for s, t, j in zip(rep["side_by_side"], rep["torch_rows"], rep["rows"], strict=True):
        assert t["peak_tflops"] == 989.0 and s["torch_mfu"] == t["mfu"]
        assert j["mfu"] / t["mfu"] == pytest.approx(s["speedup"], rel=1e-12)  # same FLOPs and peak
    assert "jaxpar / torch (compiled) gpt2-medium  B=8   T=1024  50.0 vs 60.0 ms/step  speedup 1.20x" in \
        capsys.readouterr().out


def test_a_batch_per_model_or_one_error_line(capsys):
    assert gpu_mfu.shapes(gpu_mfu.parse_args(["--models", "gpt2,gpt2-medium"])) == [("gpt2", 16), ("gpt2-medium", 8)]
    with pytest.raises(SystemExit) as e:
        gpu_mfu.shapes(gpu_mfu.parse_args(["--models", "gpt2,gpt2-medium", "--batch", "16"]))
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --batch 16 gives 1 batch sizes for 2 models\n"


def test_the_peer_without_cuda_is_one_error_line(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(gpu_mfu.xla_flags, "has_nvidia_gpu", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_mfu.main(["--models", "gpt2", "--torch", "eager"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: gpu_mfu.py --torch eager needs torch with CUDA (torch {torch.__version__} "
                                       "has none here); --torch off times jaxpar alone\n")
