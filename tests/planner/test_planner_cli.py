"""`jaxpar plan` CLI, plan.json round trip, and plan -> train overrides."""

import dataclasses
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
                   "train.grad_accum, train.remat, train.vocab_chunks, train.mlp_chunks, sharding.replicate, pipeline.gather, "
                       "tensor.sequence_parallel)")),
    (["devices=0"], "error: devices=0 must be >= 1"),
    (["device=tpu"], "error: device='tpu' is not known (choose from cpu, a100-40g, a100-80g, h100, h200)"),
    (["memory_limit=big"], "error: memory_limit='big' is not a size (e.g. 16GB, 40GiB, 1.6e10)"),
    # float() reads these; inf was an OverflowError traceback, nan "no plan fits memory_limit=nan GiB"
    (["memory_limit=inf"], "error: memory_limit='inf' is not a size (e.g. 16GB, 40GiB, 1.6e10)"),
    (["memory_limit=nanGB"], "error: memory_limit='nanGB' is not a size (e.g. 16GB, 40GiB, 1.6e10)"),
    (["device.memory=1e400"], "error: device.memory='1e400' is not a size (e.g. 16GB, 40GiB, 1.6e10)"),
    (["device.memory=-5GB"], "error: device.memory='-5GB' must be positive"),  # was "is not a number"
    (["device.peak_flops=nan"], "error: device.peak_flops='nan' is not a finite number"),  # was a plan of nan s, exit 0
    (["device.bandwidth=inf"], "error: device.bandwidth='inf' is not a finite number"),
    (["--fast"], "error: unknown flag '--fast' (valid: --json)"),
    (["model=gpt5"], ("error: model='gpt5' is not a preset (choose from gpt2-tiny, gpt2, gpt2-medium, gpt2-large, "
                      "gpt2-xl)")),
])
def test_errors_exit_2_one_line(argv, msg, capsys, tmp_path):
    assert main(argv + [f"out={tmp_path}/plan.json"]) == 2
    err = capsys.readouterr().err
    assert err == msg + "\n"


def test_one_device_and_one_row_are_accepted(tmp_path, capsys):
    """devices=1 and top=1 are the smallest values the usage allows (`_int`'s lower bound is inclusive)."""
    assert main(["model=gpt2-tiny", "devices=1", "top=1", "device=cpu", "train.batch_size=8", "train.seq_len=64",
                 f"out={tmp_path}/plan.json", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "pipe": 1}


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
    with pytest.raises(ConfigError) as e:  # bf16 halves the activations the plan's memory estimate counted
        plan_to_overrides(plan, 8, apply_overrides(cfg, {"precision": "bf16"}))
    assert str(e.value) == "plan was made for precision=fp32 (config has bf16)"


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
    # a pipelined plan carries pipeline.gather into the train config
    plan.data.update({"mesh": {"data": 1, "fsdp": 2, "tensor": 1, "pipe": 4}, "microbatches": 2, "repeats": 1,
                      "gather": "layer", "osdp": {g: "sharded" for g in ("embed", "attn", "mlp")}})
    ov = plan_to_overrides(plan, 8)
    assert (ov["pipeline.gather"], ov["mesh.pipe"]) == ("layer", "4")
    assert validate(apply_overrides(Config(), ov)).pipeline.gather == "layer"
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
    with pytest.raises(ConfigError, match=r"is not a jaxpar plan \(missing mesh, microbatches, repeats, remat, model, batch_size, seq_len, "
                                         r"precision\)$"):
        load_plan(str(bad))
    for doc in ("5", '"devices mesh microbatches repeats remat model"', "[]"):  # JSON, but not an object
        bad.write_text(doc)
        with pytest.raises(ConfigError) as e:
            load_plan(str(bad))
        assert str(e.value) == (f"plan={str(bad)!r} is not a jaxpar plan (missing devices, mesh, microbatches, "
                                "repeats, remat, model, batch_size, seq_len, precision)")
    bad.write_text("[" * 100_000 + "]" * 100_000)  # json recurses per level: a RecursionError traceback
    with pytest.raises(ConfigError) as e:
        load_plan(str(bad))
    assert str(e.value) == f"plan={str(bad)!r} is not valid JSON (nested past the parser's depth)"


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


# --- fixed keys (the ones `jaxpar train` takes) and what-if evaluation --------------------------

BASE = ["model=gpt2", "model.vocab_size=50304", "devices=8", "train.batch_size=16", "train.seq_len=256"]
GPT2_V = dataclasses.replace(PRESETS["gpt2"], vocab_size=50304)  # splits over tensor, unlike 50257


def test_fixed_keys_narrow_the_search(tmp_path, capsys):
    rc = main(BASE + ["mesh.tensor=2", "train.remat=full", "train.vocab_chunks=1", "mesh.data=-1",
                      f"out={tmp_path}/p.json", "--json", "top=4"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["fixed"] == {"mesh.tensor": "2", "train.remat": "full", "train.vocab_chunks": "1"}
    rows = [obj] + obj["candidates"]
    assert len(rows) >= 2
    for r in rows:
        assert r["mesh"]["tensor"] == 2 and r["vocab_chunks"] == 1
        assert r["remat"] == "full" or r["mesh"]["pipe"] > 1  # a pipeline remats its stages itself
    # pipeline settings keep pipeline meshes only
    assert main(BASE + ["pipeline.microbatches=4", f"out={tmp_path}/q.json", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert all(r["mesh"]["pipe"] > 1 and r["microbatches"] == 4 for r in [obj] + obj["candidates"])
    # pipeline.gather=layer keeps pipeline meshes only, each costed with per-layer gathers
    assert main(BASE + ["pipeline.gather=layer", "mesh.fsdp=2", f"out={tmp_path}/g.json", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["fixed"] == {"mesh.fsdp": "2", "pipeline.gather": "layer"}
    assert all(r["mesh"]["pipe"] > 1 and r["gather"] == "layer" for r in [obj] + obj["candidates"])
    # pipeline.schedule=1f1b keeps pipeline meshes only, each costed as 1f1b (R = 1), and plan.json
    # hands the schedule to jaxpar train
    assert main(BASE + ["pipeline.schedule=1f1b", f"out={tmp_path}/f.json", "--json", "top=4"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["fixed"] == {"pipeline.schedule": "1f1b"} and len(obj["candidates"]) >= 1
    assert all(r["mesh"]["pipe"] > 1 and r["schedule"] == "1f1b" and r["repeats"] == 1 for r in [obj] + obj["candidates"])
    plan = load_plan(f"{tmp_path}/f.json")
    assert plan.strategy.schedule == "1f1b"
    assert plan_to_overrides(plan, 8)["pipeline.schedule"] == "1f1b"
    # gradient accumulation keeps pipeline-free meshes
    assert main(BASE + ["train.grad_accum=2", f"out={tmp_path}/r.json", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert all(r["mesh"]["pipe"] == 1 and r["microbatches"] == 2 for r in [obj] + obj["candidates"])


def test_everything_fixed_is_a_what_if_with_breakdown(tmp_path, capsys):
    from jaxpar.planner.cost import Strategy, estimate
    from jaxpar.planner.devices import get_device

    fixed = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "mesh.pipe=2", "pipeline.microbatches=4",
             "pipeline.schedule=circular", "pipeline.repeats=2", "train.remat=none", "train.vocab_chunks=1",
             "train.mlp_chunks=1", "sharding.replicate=", "tensor.sequence_parallel=false"]
    assert main(BASE + fixed + [f"out={tmp_path}/p.json", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    w = Workload(GPT2_V, 16, 256)
    e = estimate(w, Strategy(2, 1, 2, 2, 4, 2, "none"), get_device("h100"))
    assert obj["search"]["evaluated"] == 1 and obj["candidates"] == []
    assert obj["step_time_s"] == e.step_time_s and obj["memory_per_device_bytes"] == int(e.memory["total"])
    assert obj["collectives"]["tensor all-reduce"]["bytes"] == int(e.collectives["tensor all-reduce"][1])
    assert obj["bubble"] == pytest.approx(1 / (2 * 4 + 1))  # (S-1)/(R·M+S-1)
    # the same with fsdp and per-layer gathers (pipeline.gather=layer)
    zero3 = [a.replace("mesh.data=2", "mesh.fsdp=2").replace("mesh.fsdp=1", "mesh.data=1") for a in fixed]
    assert main(BASE + zero3 + ["pipeline.gather=layer", f"out={tmp_path}/z.json", "--json"]) == 0
    z = json.loads(capsys.readouterr().out)
    ez = estimate(w, Strategy(1, 2, 2, 2, 4, 2, "none", gather="layer"), get_device("h100"))
    assert z["search"]["evaluated"] == 1 and z["gather"] == "layer"
    assert z["step_time_s"] == ez.step_time_s and z["memory_per_device_bytes"] == int(ez.memory["total"])
    # the human form prints the same figures, one line per collective
    assert main(BASE + fixed + [f"out={tmp_path}/p.json"]) == 0
    text = capsys.readouterr().out
    assert f"  compute  {e.compute_s:.4g} s (pipeline bubble 11.1% of it)" in text
    t, b = e.collectives["pipe ppermute"]
    assert f"  pipe ppermute            {t:.4g} s, {b / 2**30:.2f} GiB sent" in text
    assert f"MFU {100 * e.mfu:.1f}%" in text and "searched 1 strategies over 1 meshes" in text
    # without a pipeline: train.grad_accum and train.remat pin the rest
    flat = ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "mesh.pipe=1", "train.grad_accum=2", "train.remat=full",
            "train.vocab_chunks=1", "train.mlp_chunks=1", "sharding.replicate=attn"]
    assert main(BASE + flat + [f"out={tmp_path}/p.json", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    e = estimate(w, Strategy(4, 2, 1, 1, 2, 1, "full", ("attn",)), get_device("h100"))
    assert obj["search"]["evaluated"] == 1 and obj["step_time_s"] == e.step_time_s
    assert obj["remat"] == "full" and obj["osdp"] == {"embed": "sharded", "attn": "replicated", "mlp": "sharded"}


def test_fixed_config_over_memory_names_the_resource(tmp_path, capsys):
    from jaxpar.planner.cost import Strategy, estimate
    from jaxpar.planner.devices import get_device

    fixed = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipe=1", "train.grad_accum=1",
             "train.remat=none", "train.vocab_chunks=1", "train.mlp_chunks=1"]
    rc = main(BASE + fixed + ["memory_limit=1GB", f"out={tmp_path}/p.json"])
    assert rc == 2 and not (tmp_path / "p.json").exists()
    e = estimate(Workload(GPT2_V, 16, 256), Strategy(8), get_device("h100"))
    mem = e.memory
    parts = sorted(((k, v) for k, v in mem.items() if k != "total"), key=lambda kv: -kv[1])
    want = ("error: no plan fits memory_limit=0.93 GiB on 8 × h100: mesh.data=8 mesh.fsdp=1 mesh.tensor=1 "
            "mesh.pipe=1 train.grad_accum=1 train.remat=none train.vocab_chunks=1 train.mlp_chunks=1 needs "
            f"{mem['total'] / 2**30:.2f} GiB ({int(mem['total'])} bytes) per device: "
            + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts) + "\n")
    assert capsys.readouterr().err == want


@pytest.mark.parametrize("argv,msg", [
    (["mesh.tensor=3"], "error: mesh.tensor=3 (3 devices) does not divide devices=8"),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", "mesh.pipe=1"],
     "error: mesh.data=2 mesh.fsdp=2 mesh.tensor=1 mesh.pipe=1 needs 4 devices, but devices=8"),
    (["mesh.tensor=8"], "error: mesh.tensor=8 does not divide model.n_head=12 (tensor parallelism splits it)"),
    (["mesh.pipe=1", "pipeline.microbatches=4"], "error: pipeline.microbatches=4 needs a pipeline, but mesh.pipe=1"),
    (["mesh.pipe=1", "pipeline.gather=layer"], "error: pipeline.gather=layer needs a pipeline, but mesh.pipe=1"),
    (["pipeline.gather=stage"], "error: pipeline.gather='stage' must be one of step, layer"),
    (["mesh.pipe=8", "pipeline.repeats=4"],
     "error: mesh.pipe=8 × pipeline.repeats=4 = 32 virtual stages do not divide model.n_layer=12"),
    (["pipeline.schedule=gpipe", "pipeline.repeats=2"],
     "error: pipeline.schedule=gpipe with pipeline.repeats=2: gpipe and 1f1b run one repeat, circular more than one"),
    (["pipeline.schedule=1f1b", "pipeline.repeats=2"],
     "error: pipeline.schedule=1f1b with pipeline.repeats=2: gpipe and 1f1b run one repeat, circular more than one"),
    (["pipeline.schedule=1f1b", "pipeline.gather=layer"],
     "error: pipeline.schedule=1f1b with pipeline.gather=layer: 1f1b gathers a stage's fsdp-sharded weights once "
     "per step (pipeline.gather=step)"),
    (["mesh.pipe=1", "pipeline.schedule=1f1b"], "error: pipeline.schedule=1f1b needs a pipeline, but mesh.pipe=1"),
    (["pipeline.schedule=1f1b", "model.dropout=0.1"],
     "error: pipeline.schedule=1f1b does not support model.dropout=0.1 (use 0, or schedule=gpipe)"),
    (["mesh.data=2", "mesh.fsdp=2", "pipeline.microbatches=3"],
     "error: pipeline.microbatches=3 does not divide the 4 sequences per data replica "
     "(train.batch_size=16 / mesh.data×mesh.fsdp=4)"),
    (["mesh.data=8", "train.batch_size=12"],
     "error: devices=8 has no mesh with mesh.data=8 that divides train.batch_size=12 and the model's dims "
     "(model.n_embd=768, model.n_head=12, model.n_layer=12)"),
    (["mesh.pipe=2", "train.grad_accum=2"], "error: train.grad_accum=2 with a pipeline is not modelled: a pipeline "
                                            "accumulates over pipeline.microbatches (fix that instead)"),
    # the same without mesh.pipe: pipeline.microbatches asks for a pipeline
    (["pipeline.microbatches=4", "train.grad_accum=2"], "error: train.grad_accum=2 with a pipeline is not modelled: a "
                                                        "pipeline accumulates over pipeline.microbatches (fix that instead)"),
    (["train.remat=sometimes"], "error: train.remat='sometimes' must be one of none, selective, full (or true/false)"),
    (["sharding.replicate=head"], "error: sharding.replicate=head names unknown groups (head); choose from "
                                  "embed, attn, mlp"),
])
def test_fixed_keys_errors_one_line(argv, msg, capsys, tmp_path):
    assert main(BASE + argv + [f"out={tmp_path}/p.json"]) == 2
    assert capsys.readouterr().err == msg + "\n"
    assert not (tmp_path / "p.json").exists()


def test_plan_auto_offers_1f1b_only_without_dropout(monkeypatch):
    """jaxpar.parallel.layout refuses pipeline.schedule=1f1b with model.dropout > 0, so `plan=auto` must not
    offer it there (the search space it hands to plan_for), and offers it otherwise."""
    import jaxpar.planner.plan as plan_mod

    seen = []
    monkeypatch.setattr(plan_mod, "plan_for", lambda *a, space=None, **k: (seen.append(space), (None,))[1])
    for dropout in ("0.0", "0.1"):
        plan_auto(validate(apply_overrides(Config(), {"model": "gpt2-tiny", "model.dropout": dropout})), 8)
    assert [s.one_f_one_b for s in seen] == [True, False]


def test_unwritable_out_is_one_error_line_and_writes_nothing(capsys, tmp_path):
    """README: an unwritable or misplaced out= is bad input (one `error:` line, exit 2), not a
    traceback. A regular file standing where out's folder should be: the plan cannot be written."""
    blocker = tmp_path / "f"
    blocker.write_text("x")
    out = blocker / "sub" / "p.json"
    assert main(BASE + [f"out={out}"]) == 2
    assert capsys.readouterr() == ("", f"error: out={str(out)!r} cannot be written (Not a directory: {str(blocker / 'sub')!r})\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and blocker.read_text() == "x"


def test_a_plan_replicating_every_group_runs_on_all_its_devices(tmp_path):
    """fsdp with every group replicated is plain data parallelism: fsdp folds into data (2 × 4 -> 8),
    the train mesh still spans the 8 devices the plan was made for."""
    plan = _small_plan(tmp_path)
    plan.data.update({"mesh": {"data": 2, "fsdp": 4, "tensor": 1, "pipe": 1}, "microbatches": 1,
                      "osdp": {g: "replicated" for g in ("embed", "attn", "mlp")}})
    ov = plan_to_overrides(plan, 8)
    assert {k: ov[k] for k in ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.pipe", "sharding.replicate")} == \
        {"mesh.data": "8", "mesh.fsdp": "1", "mesh.tensor": "1", "mesh.pipe": "1", "sharding.replicate": ""}


def test_a_plan_for_another_vocab_is_refused(tmp_path):
    """The vocab sizes the head (its memory and FLOPs): a plan made for another one does not apply."""
    plan = _small_plan(tmp_path)
    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", "train.seq_len": "64",
                                              "precision": "fp32"}))
    assert plan_to_overrides(plan, 8, cfg)["mesh.data"]  # the plan's own config applies
    with pytest.raises(ConfigError) as e:
        plan_to_overrides(plan, 8, apply_overrides(cfg, {"model.vocab_size": "512"}))
    assert str(e.value) == "plan was made for model.vocab_size=256 (config has 512)"


def test_plan_cli_searches_1f1b_only_without_dropout():
    """As plan=auto: jaxpar train refuses pipeline.schedule=1f1b with model.dropout > 0."""
    from jaxpar.planner.cli import parse_args

    assert parse_args(["model=gpt2-tiny"])["space"].one_f_one_b is True
    assert parse_args(["model=gpt2-tiny", "model.dropout=0.1"])["space"].one_f_one_b is False


def test_plan_cli_attention_flash_is_planned_with_flash(tmp_path, capsys):
    """attention=flash reaches the cost model (no T×T scores kept) and the plan file."""
    fixed = ["model=gpt2-tiny", "devices=8", "device=h100", "train.batch_size=16", "train.seq_len=256",
             "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipe=1", "train.remat=none",
             "train.vocab_chunks=1", "train.mlp_chunks=1", "--json"]
    objs = {}
    for att in ("naive", "flash"):
        assert main(fixed + [f"attention={att}", f"out={tmp_path}/{att}.json"]) == 0
        objs[att] = json.loads(capsys.readouterr().out)
    assert (objs["naive"]["attention"], objs["flash"]["attention"]) == ("naive", "flash")
    act = {a: o["memory_breakdown_bytes"]["activations"] for a, o in objs.items()}
    assert act["flash"] < act["naive"]


# --- what `jaxpar train plan=` takes from a plan, and where the device count comes from ------


def test_a_plan_applies_its_accumulation_and_schedule(tmp_path):
    """`jaxpar train plan=` applies exactly the plan: without a pipeline its M microbatches are
    train.grad_accum; with one they are pipeline.microbatches, and the plan's schedule (1f1b,
    circular) is the train config's, not the default gpipe. A plan file written before
    pipeline.schedule existed (no "schedule" key) is a gpipe plan."""
    plan = _small_plan(tmp_path)
    plan.data.update({"mesh": {"data": 2, "fsdp": 1, "tensor": 4, "pipe": 1}, "microbatches": 4, "repeats": 1,
                      "osdp": {g: "replicated" for g in ("embed", "attn", "mlp")}})
    ov = plan_to_overrides(plan, 8)
    assert (ov["train.grad_accum"], ov["pipeline.microbatches"], ov["mesh.data"]) == ("4", "1", "2")
    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", **ov}))
    assert (cfg.train.grad_accum, cfg.pipeline.microbatches) == (4, 1)
    plan.data.update({"mesh": {"data": 4, "fsdp": 1, "tensor": 1, "pipe": 2}, "microbatches": 4, "repeats": 1,
                      "schedule": "1f1b", "layers_per_stage": [1, 1]})
    ov = plan_to_overrides(plan, 8)
    assert {k: ov[k] for k in ("pipeline.schedule", "pipeline.microbatches", "train.grad_accum")} == \
        {"pipeline.schedule": "1f1b", "pipeline.microbatches": "4", "train.grad_accum": "1"}
    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", **ov}))
    assert (cfg.pipeline.schedule, cfg.pipeline.microbatches, cfg.mesh.pipe) == ("1f1b", 4, 2)
    del plan.data["schedule"]  # an older plan file
    assert plan.strategy.schedule == "gpipe" and plan_to_overrides(plan, 8)["pipeline.schedule"] == "gpipe"


def test_save_plan_into_a_folder_not_made_yet(tmp_path):
    """out=DIR/ (trailing separator, DIR not there yet) writes DIR/plan.json, as out=DIR does for a
    folder that exists."""
    plan = _small_plan(tmp_path)
    out = str(tmp_path / "new") + "/"
    assert save_plan(plan, out) == str(tmp_path / "new" / "plan.json")
    assert load_plan(str(tmp_path / "new" / "plan.json")).data == plan.data


def test_devices_at_hand_without_a_device_count(monkeypatch, tmp_path):
    """No forced count, no GPU plugin: explicit mesh sizes give the count only when none is -1 (a
    -1 fills whatever is there); otherwise 1 for plan=auto and, for a plan file, the plan's own
    count (a CPU-only host emulates any count)."""
    import jaxpar.planner.apply as ap

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(ap, "_has_gpu_plugin", lambda: False)
    base = validate(apply_overrides(Config(), {"model": "gpt2-tiny"}))
    assert ap.devices_at_hand(apply_overrides(base, {"mesh.data": "2", "mesh.tensor": "2"})) == (4, "cpu")
    assert ap.devices_at_hand(apply_overrides(base, {"mesh.data": "-1", "mesh.tensor": "2"})) == (1, "cpu")
    plan = _small_plan(tmp_path)  # made for 8 devices
    assert ap.devices_at_hand(base, plan) == (8, "cpu") and ap.devices_at_hand(base) == (1, "cpu")


def test_a_plan_missing_a_key_is_one_error_line(tmp_path):
    """load_plan checks every key `jaxpar train plan=` reads: a plan missing "precision" (read
    only when the plan is checked against the config) is one ConfigError line naming it, not a
    KeyError traceback."""
    from dataclasses import replace

    from jaxpar.planner.apply import apply_plan

    cfg = validate(apply_overrides(Config(), {"model": "gpt2-tiny", "train.batch_size": "16", "train.seq_len": "64",
                                              "precision": "fp32"}))
    plan = _small_plan(tmp_path)
    del plan.data["precision"]
    path = save_plan(plan, str(tmp_path / "old.json"))
    with pytest.raises(ConfigError) as e:
        apply_plan(replace(cfg, plan=path), n_devices=8)
    assert str(e.value) == f"plan={path!r} is not a jaxpar plan (missing precision)"
    # a key inside "model" is read only where the plan is turned into overrides
    plan = _small_plan(tmp_path)
    del plan.data["model"]["n_embd"]
    path = save_plan(plan, str(tmp_path / "no_width.json"))
    with pytest.raises(ConfigError) as e:
        apply_plan(replace(cfg, plan=path), n_devices=8)
    assert str(e.value) == f"plan={path!r} could not be applied ('n_embd')"


def test_out_never_destroys_a_file_or_writes_into_a_run_dir(capsys, tmp_path):
    """out= naming a file that is not a plan (notes, a config) is refused and left as it was; a
    run dir (out=DIR, out=DIR/ or a file in it) gets no plan.json; a previous plan is replaced."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    cases = [(str(notes), f"{str(notes)!r} exists and is not a jaxpar plan; choose another out or move it away"),
             *((o, f"{str(run_dir)!r} is a run dir (holds config.json, ckpt); write the plan somewhere else")
               for o in (str(run_dir), f"{run_dir}/", str(run_dir / "p.json")))]
    for out, why in cases:
        assert main(BASE + [f"out={out}", "sweep=8"]) == 2
        assert capsys.readouterr() == ("", f"error: out={out!r}: {why}\n")
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt", "config.json"]
    out = tmp_path / "p.json"
    for top in ("2", "3"):  # the second replaces the first
        assert main(BASE + [f"out={out}", f"top={top}", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == load_plan(str(out)).data
