"""Layout and reduction policy of the sharded train step, on 8 emulated CPU devices.

One subprocess (the device count must be set before JAX initialises) lowers and compiles the
step and reports; the tests below assert on its JSON:

* golden snapshot of the step's key activation shardings (residual stream, qkv, MLP hidden,
  logits) per strategy, read from the sharding constraints of the lowered step (what the SPMD
  partitioner must honour), next to the parameter golden in tests/golden/. A rule table that
  drops an axis (e.g. `batch` split over `data` only, not `data` and `fsdp`) computes the same
  numbers and is only visible here or in the collective bytes.
* gradient reduction in fp32 under precision=bf16: every all-reduce / reduce-scatter of the
  compiled data=2 x fsdp=4 step carries f32.
* `jaxpar train dry_run=true` (the CLI entry, in the subprocess) prints memory and collective
  bytes, writes nothing, and its numbers are the closed-form ones.
* `sharding.replicate=embed,mlp` numerics: loss and step-1 gradient equal HF transformers'.

* golden snapshot of what the trainer compiles: the input sharding of every parameter and of
  the batch in the lowered step, for dp, fsdp, tp, dp×fsdp×tp, a pipeline and per-group replication.

Regenerate the goldens deliberately: python tests/parallel/test_policy_shardings.py --regen
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "gpt2_activation_shardings.json")
# What the trainer compiles: the input sharding of every parameter and of the batch in the lowered
# train step's signature, per layout (the 4 named meshes + a pipeline + per-group replication).
GOLDEN_COMPILED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "gpt2_compiled_shardings.json")
B, T = 8, 32  # gpt2-tiny: D=128, N=4, head_dim=32, F=512, V=256 -> every key activation has its own shape
ACTIVATIONS = {  # lowered tensor type -> (name, logical axes)
    "8x32x128xbf16": "residual (batch, seq, embed)",
    "8x32x4x32xbf16": "q/k/v (batch, seq, heads, head_dim)",  # the sliced core: fp32, dropout, GPU
    "8x32x3x4x32xbf16": "qkv (batch, seq, -, heads, head_dim)",  # bf16 CPU: mixed_attention.causal_attention_qkv
    "8x32x512xbf16": "mlp hidden (batch, seq, mlp)",
    "8x32x256xf32": "logits (batch, seq, vocab)",
}
# Per-device shapes of the MLP hidden and the logits in the compiled data=2 x fsdp=4 step: batch
# 8 -> 1 row per device; 4 or 8 rows would mean the batch is not split over data x fsdp.
COMPILED_SHAPES = ("bf16[1,32,512]", "f32[1,32,256]", "bf16[4,32,512]", "f32[4,32,256]", "bf16[8,32,512]",
                   "f32[8,32,256]")
# mesh.data=-1: the report must name the resolved mesh (data=2 on 8 devices), not the -1
DRY = ["model=gpt2-tiny", "mesh.data=-1", "mesh.fsdp=4", f"train.batch_size={B}", f"train.seq_len={T}"]
REPLICATE = ["model=gpt2-tiny", "mesh.data=2", "mesh.fsdp=4", "sharding.replicate=embed,mlp", "precision=fp32",
             f"train.batch_size={B}", f"train.seq_len={T}", "train.grad_clip=0", "train.warmup_steps=0"]


def activation_shardings(step_text: str, sizes: dict) -> dict:
    """{activation name: sorted distinct layouts} from a lowered step's StableHLO constraints
    (`sdy.sharding_constraint %x <@mesh, [{"data", "fsdp"}, {}, {}]> : tensor<8x32x128xbf16>`).
    A layout keeps the mesh axes of size > 1 (what the partitioner splits) and the per-device
    shape: "data,fsdp|-|- -> bf16[1,32,128]" on data=2 x fsdp=4."""
    out: dict = {}
    # ZeRO-3 runs the loss in a shard_map manual over the batch axes (jaxpar.parallel.fsdp):
    # there the rows are local, (B/(d·f), ...), split by the region's in_specs, not by a constraint
    manual = {a for m in re.findall(r"manual_axes=\{([^}]*)\}", step_text) for a in re.findall(r'"(\w+)"', m)}
    batch_axes = [a for a in ("data", "fsdp") if a in manual and sizes[a] > 1]
    for spec, ty in re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])> : tensor<([^>]*)>", step_text):
        dim_specs = re.findall(r"\{[^}]*\}", spec)
        if all("?" in d for d in dim_specs):
            continue  # every dim open ({?}): an unconstrained marker (shard_map emits them), not a layout
        *dims, dtype = ty.split("x")
        axes = [[a for a in re.findall(r'"(\w+)"', d) if sizes[a] > 1] for d in dim_specs]
        local_rows = "x".join([str(int(dims[0]) * int(np.prod([sizes[a] for a in batch_axes]))), *dims[1:], dtype])
        if ty not in ACTIVATIONS and batch_axes and local_rows in ACTIVATIONS:
            ty, dims, axes = local_rows, local_rows.split("x")[:-1], [[*batch_axes, *axes[0]], *axes[1:]]
        if ty not in ACTIVATIONS and len(dims) > 1 and not axes[1]:
            # data parallelism runs the loss vmapped over (G, B/G) batch groups, G over `data`
            # (jaxpar.parallel.tied): fold the group dim back into the batch dim
            dims, axes = [str(int(dims[0]) * int(dims[1])), *dims[2:]], [axes[0], *axes[2:]]
            ty = "x".join([*dims, dtype])
        if ty not in ACTIVATIONS:
            continue
        local = [int(n) // int(np.prod([sizes[a] for a in ax])) for n, ax in zip(dims, axes)]
        layout = "|".join(",".join(ax) or "-" for ax in axes) + f" -> {dtype}[{','.join(map(str, local))}]"
        out.setdefault(ACTIVATIONS[ty], set()).add(layout)
    return {k: sorted(v) for k, v in sorted(out.items())}


def input_shardings(step_text: str, args) -> dict:
    """{"params.h.attn.c_attn.weight": [[], ["fsdp"], [], ["tensor"], []], "inputs": [["data", "fsdp"], []],
    ...}: the mesh axes of each dim of every parameter and batch argument, read from the lowered
    step's signature (`%arg3: tensor<2x128xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"fsdp"}]>`),
    i.e. what jit was given and the compiled step takes. Optimizer state is left out (it
    follows the params: `optax.tree_map_params`)."""
    import jax

    sig = step_text[step_text.index("@main("):]
    sig = sig[:sig.index("\n")]
    found = dict(re.findall(r"%arg(\d+): tensor<[^>]*> \{sdy\.sharding = #sdy\.sharding<@mesh, (\[.*?\])>", sig))
    out = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(args)[0]):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        name = {1: "inputs", 2: "targets"}.get(keys[0]) or (keys[1] == "params" and ".".join(keys[2:]))
        if name:
            out[name] = [re.findall(r'"(\w+)"', d) for d in re.findall(r"\{[^}]*\}", found[str(i)])]
    return out


def _worker(out_dir: str) -> None:
    import contextlib
    import io

    import jax

    from jaxpar import cli
    from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, ShardingConfig, TrainConfig, resolve
    from jaxpar.models import gpt2
    from jaxpar.parallel import sharding as S
    from jaxpar.parallel.layout import build_layout
    from jaxpar.run.inspection import compile_step, parse_hlo
    from jaxpar.train import build_trainer

    assert jax.device_count() == 8
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.set_cache_dir(os.path.join(out_dir, "xla"))
    res: dict = {"activations": {}, "compiled": {}}
    base = Config(model=PRESETS["gpt2-tiny"], train=TrainConfig(batch_size=B, seq_len=T))
    cases = {name: dataclasses.replace(base, mesh=mc) for name, mc in S.NAMED_MESHES.items()}
    cases["pipeline"] = dataclasses.replace(base, mesh=MeshConfig(data=2, tensor=2, pipe=2),
                                            pipeline=PipelineConfig(microbatches=2))  # layers -> pipe (L=2)
    cases["replicate"] = dataclasses.replace(base, mesh=MeshConfig(data=2, fsdp=4),
                                             sharding=ShardingConfig(replicate=("embed", "mlp")))
    # ZeRO-3 on the auto-sharded step (remat=selective keeps it off parallel/fsdp.py's shard_map):
    # the only fsdp > 1 case where the activation rules, not the shard_map, place the batch
    cases["dp_fsdp_tp_auto"] = dataclasses.replace(base, mesh=S.NAMED_MESHES["dp_fsdp_tp"],
                                                   train=dataclasses.replace(base.train, remat="selective"))
    for name, cfg in cases.items():
        tr = build_trainer(build_layout(cfg, jax.device_count()))
        batch = jax.ShapeDtypeStruct((B, T), np.int32, sharding=tr.batch_sharding)
        args = (tr.abstract_state(), batch, batch)
        text = tr.step_fn.lower(*args).as_text()
        if name in S.NAMED_MESHES or name == "dp_fsdp_tp_auto":
            res["activations"][name] = activation_shardings(text, dict(tr.mesh.shape))
        if name != "dp_fsdp_tp_auto":
            res["compiled"][name] = {"mesh": dataclasses.asdict(cfg.mesh), "inputs": input_shardings(text, args)}

    # dry run through the CLI entry point, from an empty working directory
    work = os.path.join(out_dir, "cwd")
    os.makedirs(work)
    os.chdir(work)
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = cli.main(["train", *DRY, "dry_run=true", f"out={out_dir}/run"])
    res["dry_run"] = {"rc": rc, "stdout": buf.getvalue(), "stderr": err.getvalue(), "cwd_files": os.listdir(work),
                      "out_exists": os.path.exists(f"{out_dir}/run")}
    # the same step again (XLA cache hit): dtypes of every gradient reduction
    compiled, _ = compile_step(resolve(DRY))
    text = compiled.as_text()
    res["compiled_shapes"] = {t: len(re.findall(rf"\b{re.escape(t)}", text)) for t in COMPILED_SHAPES}
    kinds: dict = {}
    for comp in parse_hlo(text)["computations"].values():
        for ins in comp:
            op = ins["op"].removesuffix("-start")
            if op in ("all-reduce", "reduce-scatter") and not ins["op"].endswith("-done"):
                for dtype in re.findall(r"\b([a-z]+[0-9]*)\[", ins["type"]):
                    kinds.setdefault(op, {}).setdefault(dtype, 0)
                    kinds[op][dtype] += 1
    res["reduction_dtypes"] = kinds

    # sharding.replicate=embed,mlp: one fp32 step; gradient read back from AdamW's mu = (1-b1) g
    cfg = resolve(REPLICATE)
    tr = build_trainer(build_layout(cfg, jax.device_count()))
    x, y = np.load(os.path.join(out_dir, "batch.npy"))
    state, m = tr.step_fn(tr.init_state(gpt2.init_params(cfg.model, 0)), tr.put_batch(x), tr.put_batch(y))
    adam = next(s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    g = jax.tree.map(lambda mu: np.asarray(mu) / (1 - cfg.train.beta1), adam.mu)
    from gpt2common.hf import to_hf_state_dict

    np.savez(os.path.join(out_dir, "replicate_grads.npz"), **to_hf_state_dict(cfg.model, g))
    res["replicate"] = {"loss": float(m["loss"]), "specs": {
        jax.tree_util.keystr(p): S.spec_to_json(s.spec) for p, s in
        jax.tree_util.tree_flatten_with_path(tr.state_shardings["params"])[0]}}
    with open(os.path.join(out_dir, "out.json"), "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from gpt2common import data as data_lib

    out = tmp_path_factory.mktemp("policy_shardings")
    tokens = np.frombuffer(data_lib.builtin_text()[:50_000].encode(), np.uint8).astype(np.int32)
    np.save(out / "batch.npy", np.stack(data_lib.get_batch(tokens, data_lib.batch_offsets(len(tokens), T, B, 0, 0), T)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "out.json") as f:
        res = json.load(f)
    res["dir"] = out
    return res


def test_golden_snapshot_of_key_activation_shardings(results):
    """Reference: the committed golden, reviewed by hand: the batch dim over data AND fsdp in
    every strategy, heads / mlp / vocab over tensor, the residual stream whole over tensor; and the
    compiled step's per-device shapes (data=2 x fsdp=4: 1 row of 8 per device)."""
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert results["activations"] == golden
    assert golden["dp_fsdp_tp"]["residual (batch, seq, embed)"] == ["data,fsdp|-|- -> bf16[2,32,128]"]
    assert golden["dp_fsdp_tp"]["logits (batch, seq, vocab)"] == ["data,fsdp|-|tensor -> f32[2,32,128]"]
    assert golden["fsdp"]["mlp hidden (batch, seq, mlp)"] == ["fsdp|-|- -> bf16[1,32,512]"]
    # the auto-sharded ZeRO-3 step (remat=selective): the activation rules put batch over data×fsdp
    assert golden["dp_fsdp_tp_auto"]["residual (batch, seq, embed)"] == ["data,fsdp|-|- -> bf16[2,32,128]"]
    c = results["compiled_shapes"]
    assert c["bf16[1,32,512]"] > 0 and c["f32[1,32,256]"] > 0, c
    assert c["bf16[4,32,512]"] == c["f32[4,32,256]"] == c["bf16[8,32,512]"] == c["f32[8,32,256]"] == 0, c


def test_golden_snapshot_of_compiled_input_shardings(results):
    """Reference: the committed golden (tests/golden/gpt2_compiled_shardings.json), reviewed by
    hand; the rows below are the rules of jaxpar.parallel.layout read off it: ZeRO-3 splits embed over
    fsdp, Megatron heads / mlp / vocab over tensor, a pipeline stores the stacked `layers` dim
    over pipe, sharding.replicate keeps its groups whole over fsdp, the batch rows over data×fsdp."""
    with open(GOLDEN_COMPILED) as f:
        golden = json.load(f)
    assert results["compiled"] == golden
    assert sorted(golden) == ["dp", "dp_fsdp_tp", "fsdp", "pipeline", "replicate", "tp"]
    g = {k: v["inputs"] for k, v in golden.items()}
    assert all(ax == [] for k, v in g["dp"].items() if k not in ("inputs", "targets") for ax in v)  # replicated
    assert all(v["inputs"] == v["targets"] == [["data", "fsdp"], []] for v in g.values())  # size-1 axes included
    assert g["fsdp"]["h.mlp.c_fc.weight"] == [[], ["fsdp"], []] and g["fsdp"]["wte.weight"] == [[], ["fsdp"]]
    assert g["tp"]["h.attn.c_attn.weight"] == [[], [], [], ["tensor"], []] and g["tp"]["wte.weight"] == [["tensor"], []]
    assert g["dp_fsdp_tp"]["h.mlp.c_proj.weight"] == [[], ["tensor"], ["fsdp"]]
    assert g["dp_fsdp_tp"]["inputs"] == [["data", "fsdp"], []]
    pipe = g["pipeline"]
    assert all(v[0] == ["pipe"] for k, v in pipe.items() if k.startswith("h."))  # layers -> pipe
    assert pipe["h.mlp.c_fc.weight"] == [["pipe"], [], ["tensor"]] and pipe["wte.weight"] == [["tensor"], []]
    rep = g["replicate"]
    assert rep["h.attn.c_attn.weight"] == [[], ["fsdp"], [], [], []]  # attn: ZeRO-3
    assert rep["h.mlp.c_fc.weight"] == [[], [], []] and rep["wte.weight"] == [[], []]  # mlp, embed: whole


def test_gradient_reduction_is_fp32_under_bf16(results):
    """Reference: the policy (fp32 master weights, grads and reduction); hand-read from the HLO of
    the step training runs, whose one int32 all-reduce is the stop flag's max (Trainer.loop_step_fn)."""
    kinds = results["reduction_dtypes"]
    assert set(kinds) <= {"all-reduce", "reduce-scatter"}
    assert kinds["all-reduce"]["s32"] == 1 and kinds["all-reduce"]["f32"] >= 1
    assert {d for k in kinds.values() for d in k} == {"f32", "s32"}
    assert all(set(v) == {"f32"} for k, v in kinds.items() if k != "all-reduce")


def test_dry_run_prints_memory_and_bytes_and_writes_nothing(results):
    """Reference: closed forms. Arguments = fp32 params + AdamW mu and nu, ZeRO-3 over fsdp=4
    (`sharding.local_shard_elements`), + the optimizer's two int32 counters, the int32 step, the
    two (B/8, T) int32 batch shards and the stop flag's int32. Measured bytes vs theory is tested
    with jaxpar.run.inspection (tests/parallel/test_comm_bytes.py); here the printed numbers and the theory's closed form."""
    from jaxpar.config import PRESETS, MeshConfig
    from jaxpar.parallel.sharding import local_shard_elements

    d = results["dry_run"]
    assert d["rc"] == 0 and d["stderr"] == "", d["stderr"]
    assert d["cwd_files"] == [] and d["out_exists"] is False
    lines = d["stdout"].splitlines()
    assert lines[0].startswith("inspect: gpt2-tiny (462,336 params), mesh data=2×fsdp=4×tensor=1×pipe=1")
    assert lines[1].startswith("memory per device: total ")
    info = json.loads(lines[-1])
    mem = info["memory_per_device_bytes"]
    local = local_shard_elements(PRESETS["gpt2-tiny"], MeshConfig(data=2, fsdp=4))
    # + the loop step's stop flag: one int32 per device
    assert mem["arguments"] == 3 * 4 * local + 3 * 4 + 2 * (B // 8) * T * 4 + 4, (mem, local)
    assert mem["total"] == mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temp"]
    assert mem["aliased"] == 3 * 4 * local + 3 * 4  # the donated state is updated in place
    # collective bytes: the textbook figures for data=2 x fsdp=4 (Ψ = 462,336 fp32 params), and the
    # measured total as the sum of its kinds, printed in the report's total line
    th, coll = info["theory"], info["collectives"]
    m = PRESETS["gpt2-tiny"]
    psi = m.num_params()
    # ZeRO-3: blocks gathered twice + reduce-scattered, wte/wpe/ln_f gathered once + reduce-scattered
    outer = m.vocab_size * m.n_embd + m.n_positions * m.n_embd + 2 * m.n_embd
    assert th["params"] == psi and th["dp"] == 2 * 1 / 2 * psi / 4 * 4
    assert th["fsdp"] == 3 / 4 * (3 * (psi - outer) + 2 * outer) * 4
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    assert coll["total_wire_bytes"] == sum(coll[k]["wire_bytes"] for k in kinds)
    # ZeRO-3 reduce-scatters (jaxpar.parallel.fsdp): within 5% of the theory (the rest: scalars and
    # the two biases with no embed dim, all-reduced over fsdp)
    assert 0.95 * th["total"] <= coll["total_wire_bytes"] <= 1.05 * th["total"], (coll, th)
    assert f"{coll['total_wire_bytes'] / 2**20:,.2f} MiB" in next(ln for ln in lines if ln.startswith("  total"))
    # what the report prints is the JSON's numbers, each under its own label: the resolved mesh,
    # measured/theory (not its inverse), memory parts and each kind's payload and wire columns
    assert info["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1, "pipe": 1}
    assert info["ratio"] == coll["total_wire_bytes"] / th["total"]
    assert lines[-2].endswith(f"; measured/theory = {info['ratio']:.3f}"), lines[-2]
    mib = lambda x: f"{x / 2**20:,.2f} MiB"  # noqa: E731
    assert lines[1] == (f"memory per device: total {mib(mem['total'])} (arguments {mib(mem['arguments'])}, outputs "
                        f"{mib(mem['outputs'])}, aliased {mib(mem['aliased'])}, temp {mib(mem['temp'])})")
    assert mib(mem["temp"]) != mib(mem["code"])  # (so a wrong key shows; outputs and aliased print alike)
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.startswith("  ") and ln.split()[0] in kinds}
    assert set(rows) == {k for k in kinds if coll[k]["ops"]} and len(rows) >= 2
    for k, cols in rows.items():
        c = coll[k]
        assert cols == [str(c["ops"]), f"{c['executions']:.0f}", mib(c["payload_bytes"])[:-4], "MiB",
                        mib(c["wire_bytes"])[:-4], "MiB"], (k, cols, c)
    assert coll["all-gather"]["payload_bytes"] != coll["all-gather"]["wire_bytes"]  # (3/4: the columns tell apart)


def test_replicate_numerics_equal_hf_transformers(results):
    """Reference: HF transformers GPT2LMHeadModel, fp32, same init and batch (loss and the
    gradient of every tensor; jaxpar's read back from AdamW's first moment, clipping off).
    Bounds: jaxpar/tolerances.py parity.model.loss / parity.model.grad (MODEL; inf-norm relative)."""
    import torch
    from support.claims_helpers import hf_model

    from jaxpar.config import PRESETS
    from jaxpar.models import gpt2
    from parity_tests.tolerances import MODEL

    specs = results["replicate"]["specs"]
    assert specs["['h']['attn']['c_attn']['weight']"] == [None, "fsdp", None, None, None]  # ZeRO-3
    assert specs["['h']['mlp']['c_fc']['weight']"] == [None, None, None] and specs["['wte']['weight']"] == [None, None]
    x, y = np.load(results["dir"] / "batch.npy")
    model = hf_model(PRESETS["gpt2-tiny"], gpt2.init_params(PRESETS["gpt2-tiny"], 0))
    model.train()  # dropout is 0: train mode only enables autograd bookkeeping
    logits = model(torch.from_numpy(x.astype(np.int64))).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.from_numpy(y.astype(np.int64)).reshape(-1))
    loss.backward()
    want = {n: p.grad.numpy() for n, p in model.named_parameters()}
    got = dict(np.load(results["dir"] / "replicate_grads.npz"))
    assert abs(results["replicate"]["loss"] - loss.item()) <= MODEL["loss_rel"] * loss.item()
    assert got.keys() == want.keys() and len(got) == 4 + 12 * 2
    worst = max((float(np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k]))), k) for k in want)
    assert worst[0] <= MODEL["grad_rel"], worst


if __name__ == "__main__":
    if sys.argv[1] == "--regen":
        import tempfile

        os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")

        with tempfile.TemporaryDirectory() as d:
            from gpt2common import data as data_lib

            toks = np.frombuffer(data_lib.builtin_text()[:50_000].encode(), np.uint8).astype(np.int32)
            np.save(os.path.join(d, "batch.npy"),
                    np.stack(data_lib.get_batch(toks, data_lib.batch_offsets(len(toks), T, B, 0, 0), T)))
            _worker(d)
            with open(os.path.join(d, "out.json")) as f:
                out = json.load(f)
        for path, value in ((GOLDEN, out["activations"]), (GOLDEN_COMPILED, out["compiled"])):
            with open(path, "w") as f:
                json.dump(value, f, indent=1, sort_keys=True)
                f.write("\n")
    else:
        _worker(sys.argv[1])
