"""MFU's device peak comes from the planner's device table (jaxpar/planner/devices.py), the one
place peak figures live; train only maps the JAX device kind to a row."""

import dataclasses
from types import SimpleNamespace

import jax
import pytest

from jaxpar.config import resolve
from jaxpar.planner import devices
from jaxpar.planner.devices import spec_for_device_kind
from jaxpar.train import device_peak_flops


@pytest.mark.parametrize("kind,row", [
    ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100 80GB PCIe", "a100-80g"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("cpu", None), ("TPU v4", None)])
def test_device_kind_to_table_row(kind, row):
    spec = spec_for_device_kind(kind)
    assert (spec.name if spec else None) == row


def _fake_gpu(monkeypatch, kind):
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(device_kind=kind, platform="gpu")])


def test_train_peak_reads_the_planner_table(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(resolve(["precision=bf16"])) == 989e12
    assert device_peak_flops(resolve(["precision=fp32"])) == 67e12
    assert device_peak_flops(resolve(["precision=bf16", "device_peak_flops=1e12"])) == 1e12
    # One table: a changed planner row is what MFU divides by.
    h100 = dataclasses.replace(devices.DEVICES["h100"], peak_flops=500e12, peak_flops_fp32=50e12)
    monkeypatch.setitem(devices.DEVICES, "h100", h100)
    assert device_peak_flops(resolve(["precision=bf16"])) == 500e12
    assert device_peak_flops(resolve(["precision=fp32"])) == 50e12
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB")
    assert device_peak_flops(resolve(["precision=bf16"])) == 312e12


@pytest.mark.parametrize("kind,row", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100-40g"),
                                      ("NVIDIA A100 80GB PCIe", "a100-80g"), ("NVIDIA L4", "h100")])
def test_plan_auto_on_a_gpu_uses_the_same_row(monkeypatch, kind, row):
    """`train plan=auto` on a GPU host plans for the row MFU uses (an unknown GPU: h100)."""
    from jaxpar.planner import apply

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(apply, "_has_gpu_plugin", lambda: True)
    _fake_gpu(monkeypatch, kind)
    monkeypatch.setattr(jax, "device_count", lambda *a: 4)
    assert apply.devices_at_hand(resolve([])) == (4, row)


@pytest.mark.parametrize("kind,platform", [("cpu", "cpu"), ("NVIDIA L4", "gpu"), ("TPU v4", "tpu")])
def test_no_peak_is_claimed_for_a_device_outside_the_table(monkeypatch, kind, platform):
    """MFU needs a peak the program knows: the GPU table or device_peak_flops=; anything else has none."""
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(device_kind=kind, platform=platform)])
    assert device_peak_flops(resolve([])) is None
    assert device_peak_flops(resolve(["device_peak_flops=2.5e11"])) == 2.5e11
