"""`jaxpar plan` CLI, plan.json round trip, and plan -> train overrides."""

import json

import pytest

from jaxpar.config import PRESETS, Config, ConfigError, apply_overrides, validate
from jaxpar.planner.cli import main
from jaxpar.planner.cost import Workload
from jaxpar.planner.plan import load_plan, plan_auto, plan_for, plan_to_overrides, save_plan

FIELDS = ("mesh", "memory_per_device_bytes", "step_time_s", "mfu")


def test_json_output_and_plan_file(tmp_path, capsys):
    out = tmp_path / "p" / "plan.json"
    rc = main(["model=gpt2-xl", "devices=64", "device=h100", "train.batch_size=512", "train.seq_len=1024",
               f"out={out}", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    for k in FIELDS + ("candidates",):
        assert k in obj
    assert set(obj["mesh"]) == {"data", "fsdp", "tensor", "pipe"}
    for c in [obj] + obj["candidates"]:
        assert all(k in c for k in FIELDS)
        m = c["mesh"]
        assert m["data"] * m["fsdp"] * m["tensor"] * m["pipe"] == 64
        assert c["memory_per_device_bytes"] <= 80 * 2**30 and 0 < c["mfu"] < 1
    assert obj["step_time_s"] <= min(c["step_time_s"] for c in obj["candidates"])
    assert json.loads(out.read_text())["mesh"] == obj["mesh"]
    assert load_plan(str(out)).devices == 64


def test_human_table(tmp_path, capsys):
    assert main(["model=gpt2", "devices=8", "train.batch_size=16", f"out={tmp_path}/", "top=3"]) == 0
    text = capsys.readouterr().out
    assert "mesh d×f×t×p" in text and "chosen: mesh " in text and (tmp_path / "plan.json").exists()
    assert text.count("GiB │") == 3  # three candidate rows


@pytest.mark.parametrize("argv,msg", [
    (["bogus=1"], ("error: unknown key 'bogus' (valid: model, model.*, train.batch_size, train.seq_len, precision, "
                   "device.*, devices, device, memory_limit, out, sweep, top, space, attention, mesh.data, mesh.fsdp, "
                   "mesh.tensor, mesh.pipe, pipeline.microbatches, pipeline.schedule, pipeline.repeats, "
                   "train.grad_accum, train.remat, train.vocab_chunks, train.mlp_chunks, sharding.replicate)")),
    (["devices=0"], "error: devices=0 must be >= 1"),
    (["device=tpu"], "error: device='tpu' is not known (choose from cpu, a100-40g, a100-80g, h100, h200)"),
    (["memory_limit=big"], "error: memory_limit='big' is not a size (e.g. 16GB, 40GiB, 1.6e10)"),
    (["--fast"], "error: unknown flag '--fast' (valid: --json)"),
    (["model=gpt5"], ("error: model='gpt5' is not a preset (choose from gpt2-tiny, gpt2, gpt2-medium, gpt2-large, "
                      "gpt2-xl)")),
])
def test_errors_exit_2_one_line(argv, msg, capsys, tmp_path):
    assert main(argv + [f"out={tmp_path}/plan.json"]) == 2
    err = capsys.readouterr().err
    assert err == msg + "\n"


def test_no_fit_exit_2_names_smallest_memory(capsys, tmp_path):
    rc = main(["model=gpt2-xl", "devices=8", "train.batch_size=64", "train.seq_len=1024", "memory_limit=1GB",
               f"out={tmp_path}/plan.json"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no plan fits memory_limit=0.93 GiB on 8 × h100: the smallest per-device memory "
                          "any plan needs is ") and err.count("\n") == 1
    assert not (tmp_path / "plan.json").exists()


def test_sweep_writes_png(tmp_path, capsys):
    rc = main(["model=gpt2", "devices=8", "train.batch_size=64", f"out={tmp_path}/plan.json", "sweep=8,16,64,13",
               "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    png = tmp_path / "plan_sweep.png"
    assert obj["sweep_png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pts = {p["devices"]: p for p in obj["sweep"]}
    assert pts[13]["error"].startswith("devices=13 has no mesh that divides train.batch_size=64")
    assert pts[64]["tokens_per_s"] > pts[8]["tokens_per_s"]


def _small_plan(tmp_path, space=None, **kw):
    w = Workload(PRESETS["gpt2-tiny"], 16, 64, "fp32")
    plan, _ = plan_for(w, 8, "cpu", space=space, **kw)
    return load_plan(save_plan(plan, str(tmp_path / "plan.json")))


def test_plan_to_overrides_refuses_other_device_count(tmp_path):
    plan = _small_plan(tmp_path)
    with pytest.raises(ConfigError) as e:
        plan_to_overrides(plan, 4)
    assert str(e.value) == ("plan was made for devices=8, but 4 devices are available "
                            "(re-run `jaxpar plan devices=4` or use plan=auto)")


def test_plan_auto_overrides_apply_to_train_config(tmp_path):
    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", "train.seq_len": "64",
                                              "precision": "fp32"}))
    plan = plan_auto(cfg, 8)
    ov = plan_to_overrides(plan, 8, cfg)
    new = validate(apply_overrides(cfg, ov))
    m = new.mesh
    assert m.data * m.fsdp * m.tensor * m.pipe == 8
    assert (m.data, m.fsdp, m.tensor, m.pipe) == tuple(plan.mesh[k] for k in ("data", "fsdp", "tensor", "pipe"))
    assert new.train.remat == plan.data["remat"]
    assert (new.train.vocab_chunks, new.train.mlp_chunks) == (plan.data["vocab_chunks"], plan.data["mlp_chunks"])
    other = apply_overrides(cfg, {"train.seq_len": "32"})
    with pytest.raises(ConfigError) as e:
        plan_to_overrides(plan, 8, other)
    assert str(e.value) == "plan was made for train.seq_len=64 (config has 32)"


def test_plan_with_selective_splitting_and_osdp_applies(tmp_path):
    plan = _small_plan(tmp_path)
    plan.data.update({"remat": "selective", "vocab_chunks": 8, "mlp_chunks": 4,
                      "mesh": {"data": 2, "fsdp": 4, "tensor": 1, "pipe": 1}, "microbatches": 1,
                      "osdp": {"embed": "replicated", "attn": "sharded", "mlp": "replicated"}})
    ov = plan_to_overrides(plan, 8)
    assert {k: ov[k] for k in ("train.remat", "train.vocab_chunks", "train.mlp_chunks", "sharding.replicate",
                               "mesh.fsdp")} == {"train.remat": "selective", "train.vocab_chunks": "8",
                                                 "train.mlp_chunks": "4", "sharding.replicate": "embed,mlp",
                                                 "mesh.fsdp": "4"}
    plan.data.update({"mlp_chunks": 3})
    with pytest.raises(ConfigError) as e:
        plan_to_overrides(plan, 8)
    assert str(e.value).startswith("plan uses vocab_chunks=8, mlp_chunks=3; jaxpar train needs them to divide ")


def test_load_plan_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_plan(str(tmp_path / "nope.json"))
    assert str(e.value) == f"plan={str(tmp_path / 'nope.json')!r} does not exist"
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": 8}')
    with pytest.raises(ConfigError, match=r"is not a jaxpar plan \(missing mesh, microbatches, repeats, remat, model\)$"):
        load_plan(str(bad))


def test_apply_plan_for_train(tmp_path, monkeypatch):
    from dataclasses import replace

    from jaxpar.planner.apply import apply_plan, devices_at_hand

    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", "train.seq_len": "64",
                                              "precision": "fp32"}))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert devices_at_hand(cfg) == (8, "cpu")
    new = apply_plan(replace(cfg, plan="auto"))
    m = new.mesh
    assert m.data * m.fsdp * m.tensor * m.pipe == 8 and new.plan == "auto"
    path = save_plan(plan_auto(cfg, 8), str(tmp_path / "plan.json"))
    assert apply_plan(replace(cfg, plan=path)).mesh == m
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    with pytest.raises(ConfigError) as e:
        apply_plan(replace(cfg, plan=path))
    assert str(e.value).startswith("plan was made for devices=8, but 4 devices are available")
