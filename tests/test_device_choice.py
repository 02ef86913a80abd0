"""The default suite runs on the CPU wherever it runs, and nothing moves to a GPU because one exists.

On a machine without a GPU these tests pretend one (torch.cuda.is_available patched to True, an
NVIDIA device node present, an H100 reported as jax's accelerator) and check that the default
paths still choose the CPU: the suite's pin (root conftest.py), torchref's device (the config's
`device`, CPU unless asked), the CLI's GPU flags (only where JAX_PLATFORMS allows the GPU). A user's
`jaxpar train` keeps jax's own choice: the CLI never pins a platform.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxpar.config import MeshConfig
from jaxpar.parallel import mesh as M
from jaxpar.run import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest(request):
    return next(p for p in request.config.pluginmanager.get_plugins()
                if getattr(p, "__file__", None) == str(ROOT / "conftest.py"))


@pytest.mark.parametrize("expr, lane", [
    ("", False), ("not slow and not gpu", False), ("not gpu", False), ("slow", False),
    ("gpu", True), ("gpu and not slow", True), ("slow or gpu", True),
])
def test_only_a_marker_expression_naming_gpu_lifts_the_pin(request, expr, lane):
    assert _root_conftest(request).selects_gpu_lane(expr) is lane


def test_this_run_and_the_subprocesses_it_starts_are_on_cpu():
    """The pin is in the environment, so a subprocess that inherits it (the CLI tests', the parity
    runs') starts jax on the CPU too, with a GPU present or not."""
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.default_backend() == "cpu" and {d.platform for d in jax.devices()} == {"cpu"}
    code = "import os, jax; print(os.environ['JAX_PLATFORMS'], jax.default_backend())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-1000:]
    assert r.stdout.split() == ["cpu", "cpu"]


def test_gpu_flags_follow_jax_platforms_with_a_gpu_present(monkeypatch):
    """An NVIDIA device node present: the CLI adds its GPU XLA flags for a user (no JAX_PLATFORMS),
    and none under the suite's pin."""
    monkeypatch.setattr(xla_flags.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    pinned, user = {"JAX_PLATFORMS": "cpu"}, {}
    assert xla_flags.apply_gpu_defaults(pinned) is False and "XLA_FLAGS" not in pinned
    assert xla_flags.apply_gpu_defaults(user) is True
    assert user["XLA_FLAGS"].split() == list(xla_flags.GPU_FLAGS)


def test_the_cli_device_setup_never_pins_a_platform(monkeypatch):
    """`jaxpar train mesh.data=2` asks XLA for 2 host devices (a flag GPU backends ignore) and leaves
    JAX_PLATFORMS alone: on a GPU machine jax then starts on the GPU."""
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setenv("XLA_FLAGS", "")
    for var in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert M.emulate_devices_for(MeshConfig(data=2)) == 2
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert "JAX_PLATFORMS" not in os.environ


# ----------------------------------------------------------------------------- torchref

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from gpt2common import data as data_lib

    d = tmp_path_factory.mktemp("dev") / "data"
    data_lib.prepare(data_lib.builtin_text()[:20_000], str(d), "byte", source="tinyshakespeare[:20000]")
    return str(d)


@pytest.fixture
def cuda_present(monkeypatch):
    """torch reports one CUDA GPU; `set_device` records its argument instead of touching a driver."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def _context(prepared, tmp_path, *args):
    from torchref.config import resolve_ref
    from torchref.runtime import Context, Job

    cfg, ref = resolve_ref(["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=4", *args])
    threads = torch.get_num_threads()
    try:
        return Context(Job(cfg, ref, prepared, "", str(tmp_path)), rank=1, world=2)
    finally:
        torch.set_num_threads(threads)  # a worker's setting; keep this test process's own


@pytest.mark.parametrize("strategy", ["distributed-ps", "horovod", "single-ps"])
def test_torchref_stays_on_cpu_with_cuda_present(prepared, tmp_path, cuda_present, strategy):
    """The reported failure: Context.shard returned CUDA tensors on a GPU machine and the parity test's
    .numpy() raised. Default device: the CPU, gloo, batches numpy-readable, no GPU selected."""
    ctx = _context(prepared, tmp_path, f"strategy={strategy}", "workers=2")
    assert (ctx.device, ctx.backend, cuda_present) == (torch.device("cpu"), "gloo", [])
    x, y = ctx.shard(0, 1, 2)
    gx, gy = ctx.global_batch(0)
    assert x.device.type == "cpu" and (x.numpy() == gx[2:]).all() and (y.numpy() == gy[2:]).all()


def test_torchref_takes_the_gpu_when_asked(prepared, tmp_path, cuda_present):
    ctx = _context(prepared, tmp_path, "strategy=distributed-ps", "workers=2", "device=cuda")
    assert (ctx.device, ctx.backend, cuda_present) == (torch.device("cuda", 0), "nccl", [torch.device("cuda", 0)])


@pytest.mark.parametrize("args, msg", [
    (["device=tpu"], "device='tpu' must be cpu or cuda"),
    (["backend=nccl"], "backend=nccl needs device=cuda (NCCL moves GPU tensors; device=cpu)"),
])
def test_torchref_device_errors(args, msg):
    from gpt2common.grammar import ConfigError
    from torchref.config import resolve_ref

    with pytest.raises(ConfigError) as e:
        resolve_ref(["strategy=distributed-ps", "workers=2", *args])
    assert str(e.value) == msg


def test_torchref_device_cuda_without_cuda_is_refused_before_any_process(monkeypatch, tmp_path):
    from gpt2common.grammar import ConfigError
    from torchref import launch
    from torchref.config import resolve_ref

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg, ref = resolve_ref(["strategy=distributed-ps", "workers=2", "device=cuda", f"out={tmp_path / 'r'}"])
    with pytest.raises(ConfigError) as e:
        launch.train(cfg, ref)
    assert str(e.value) == "device=cuda needs a CUDA GPU (torch.cuda.is_available() is False here)"
    assert not (tmp_path / "r").exists()


def test_async_ps_on_a_gpu_machine_is_not_refused_for_cuda_it_does_not_use(cuda_present):
    """ps.async needs gloo; with CUDA present and the default device it is gloo, so it is accepted."""
    from torchref.config import resolve_ref

    _, ref = resolve_ref(["strategy=single-ps", "workers=2", "ps.async=true"])
    assert (ref.device, ref.dist_backend) == ("cpu", "gloo")


def test_only_torchref_runtime_and_launch_ask_whether_cuda_exists():
    """Where tensors live is the config's: no other torchref or parity module reads CUDA's presence."""
    readers = sorted(str(p.relative_to(ROOT)) for d in ("torchref", "parity_tests") for p in (ROOT / d).rglob("*.py")
                     if "cuda.is_available" in p.read_text())
    assert readers == ["torchref/launch.py"]


# ----------------------------------------------------------------------------- the GPU lane's plumbing

def test_the_gpu_lane_is_out_of_the_default_run_and_every_file_skips_without_a_gpu():
    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow and not gpu'" in ini["addopts"] and "-rs" in ini["addopts"].split()
    assert any(m.startswith("gpu:") for m in ini["markers"])
    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
    assert [f.name for f in files] == ["test_gpu_attention.py", "test_gpu_checkpoints.py", "test_gpu_cli.py",
                                       "test_gpu_mfu.py", "test_gpu_step.py", "test_gpu_torchref.py"]
    for f in files:
        text = f.read_text()
        assert "pytestmark = pytest.mark.gpu\n" in text and "@pytest.fixture(autouse=True, scope=\"module\")\n" \
            "def _gpu():\n    require_gpu()\n" in text, f.name


def test_the_lane_names_why_it_cannot_run(monkeypatch):
    from support import gpu

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert gpu.no_gpu_reason() == "JAX_PLATFORMS=cpu pins this run to the CPU (the GPU lane is `python -m pytest -m gpu`)"
    monkeypatch.delenv("JAX_PLATFORMS")
    assert gpu.no_gpu_reason() == "no GPU here: jax's default backend is cpu (cpu)"
    assert "JAX_PLATFORMS" not in gpu.gpu_env() and gpu.gpu_env()["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert gpu.cpu_env()["JAX_PLATFORMS"] == "cpu"
