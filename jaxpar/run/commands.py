"""The CLI's commands. Each takes argv (after the command name) and returns an exit code.

JAX-importing modules are imported inside the functions, after `_devices_for()` has had
the chance to ask XLA for emulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from gpt2common.grammar import parse_kv
from jaxpar import config as C
from jaxpar.config import ConfigError
from jaxpar.run import options as O
from jaxpar.run.rundir import run_config


def _parse(argv: list[str]) -> C.Config:
    """--config FILE + key=value args -> validated Config."""
    from jaxpar.config import split_config_flag

    path, rest = split_config_flag(argv)
    return C.resolve(rest, path)


def _devices_for(cfg: C.Config) -> None:
    """`jaxpar.parallel.mesh.setup_devices` for cfg's mesh (before JAX initialises)."""
    from jaxpar.parallel import mesh

    mesh.setup_devices(cfg.mesh)


def train(argv: list[str], dry_run: bool = False) -> int:
    from jaxpar.config import split_config_flag
    from jaxpar.run.rundir import resolve_train

    path, rest = split_config_flag(argv)
    cfg = resolve_train(parse_kv(rest), path, writer=not dry_run)  # resume=true: its config.json + these keys
    if cfg.plan:
        from jaxpar.planner.apply import apply_plan  # noqa: PLC0415

        cfg = apply_plan(cfg)
    _devices_for(cfg)
    if dry_run or cfg.dry_run:
        from jaxpar.run.inspection import run_inspect

        if cfg.init:  # the model train would build: init='s shape (its config.json; no weights read)
            from gpt2common import hf
            from jaxpar.run.loop import shaped_by_init

            cfg = shaped_by_init(cfg, hf.load_hf_config(cfg.init, "init"))
        return run_inspect(cfg)
    from jaxpar.run.loop import run_train

    return run_train(cfg)


def inspect(argv: list[str]) -> int:
    return train(argv, dry_run=True)


def prepare(argv: list[str]) -> int:
    from gpt2common import data
    from gpt2common.grammar import parse_value
    from gpt2common.outdir import check_writable, hold
    from gpt2common.prepare import PROGRESS

    kv = parse_kv(argv, once=True)
    unknown = set(kv) - set(O.names(O.PrepareOptions))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(unknown))} (valid: {', '.join(O.names(O.PrepareOptions))})")
    if "out" not in kv:
        raise ConfigError("prepare needs out=<dir>")
    d = O.PrepareOptions()
    workers = parse_value(int, kv.get("workers", d.workers), "workers")
    val_fraction = parse_value(float, kv.get("val_fraction", d.val_fraction), "val_fraction")
    seed = parse_value(int, kv.get("seed", d.seed), "seed")
    shard_tokens = parse_value(int, kv.get("shard_tokens", d.shard_tokens), "shard_tokens")
    if workers < 0:
        raise ConfigError(f"workers={workers} must be >= 0 (0: the cores this process may use)")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must be in (0, 1)")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens} must be positive")
    if not kv.get("text_key", d.text_key):
        raise ConfigError("text_key='' names no field")
    workers = workers or len(os.sched_getaffinity(0))
    out = kv["out"]
    check_writable(out)
    held = [f for f in ("meta.json", "train.bin", "val.bin") if os.path.exists(os.path.join(out, f))]
    if os.path.exists(os.path.join(out, "meta.json")) or (held and not os.path.exists(os.path.join(out, PROGRESS))):
        # a run may be reading it: replacing it silently would change that run's data
        raise ConfigError(f"out={out!r} already holds prepared data ({', '.join(held)}); "
                          "choose a new out= or delete it first")
    lock = hold(out)
    try:
        meta = data.prepare_input(kv.get("input", ""), out, kv.get("tokenizer", d.tokenizer),
                                  text_key=kv.get("text_key", d.text_key), workers=workers, val_fraction=val_fraction,
                                  seed=seed, shard_tokens=shard_tokens, min_tokens=2, key="input")
    finally:
        lock.release()
    print(json.dumps(meta))
    return 0


def load_model(checkpoint: str = "", hf_dir: str = ""):
    """(Config of the run or a default one, params) from a run dir or HF dir, on one device
    (the first), whatever mesh wrote the checkpoint. For mesh placement see `jaxpar.run.infer`."""
    from gpt2common import hf

    if hf_dir:
        mc, params = hf.load_hf(hf_dir, "hf")
        return C.Config(model=mc, model_name=f"hf:{hf_dir}"), params
    import jax

    from jaxpar.models import gpt2
    from jaxpar.run.checkpoint import restore

    run_cfg = run_config(checkpoint)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                            gpt2.abstract_params(run_cfg.model))
    return run_cfg, restore(checkpoint, abstract).params


def _inference_base(checkpoint: str, hf_dir: str) -> tuple[C.Config, dict | None]:
    """Base config for eval/sample: the run's own (or the HF model's) with one device and exact
    fp32 as defaults; `mesh.*`, `pipeline.*`, `precision` given by the user apply on top.
    Host params too when loading an HF dir (a checkpoint is read after the devices exist)."""
    if hf_dir:
        from gpt2common import hf

        mc, params = hf.load_hf(hf_dir, "hf")
        return C.Config(model=mc, model_name=f"hf:{hf_dir}", precision="fp32"), params
    # sequence parallelism is a training memory choice tied to the run's tensor degree: off by default
    return dataclasses.replace(run_config(checkpoint), mesh=C.MeshConfig(), tensor=C.TensorConfig(),
                               precision="fp32"), None


def _run_data(checkpoint: str) -> str:
    """The prepared data a run trained on, for `eval` without data=: `<run>/data` (where raw text
    and the built-in corpus are tokenized), else the prepared dir its config.json names."""
    from gpt2common import data as data_lib

    if checkpoint:
        if data_lib.is_prepared(own := os.path.join(checkpoint, "data")):
            return own
        named = run_config(checkpoint).data
        if named and data_lib.is_prepared(named):
            return named
    raise ConfigError("eval needs data=<prepared dir | .bin file>" +
                      (f" (checkpoint={checkpoint!r} holds no prepared data)" if checkpoint else ""))


def evaluate(argv: list[str]) -> int:
    """Loss over windows k*T..k*T+T of val.bin (or a .bin); prints {"loss","perplexity","tokens"}.
    Runs on one device, or on the mesh given by `mesh.*` (through the pipeline if mesh.pipe > 1)."""
    import math

    from gpt2common import data as data_lib
    from jaxpar.config import split_config_flag

    path, rest = split_config_flag(argv)
    kv = parse_kv(rest, once=O.ONCE_KEYS["eval"])
    ckpt, hf_dir, data_arg = kv.pop("checkpoint", ""), kv.pop("hf", ""), kv.pop("data", "")
    if bool(ckpt) == bool(hf_dir):
        raise ConfigError("eval needs exactly one of checkpoint=<run dir> or hf=<dir>")
    if not data_arg:
        data_arg = _run_data(ckpt)
    base, hf_params = _inference_base(ckpt, hf_dir)
    cfg = C.resolve_kv(kv, path, base)
    if os.path.isdir(data_arg):
        tokens = data_lib.load_split(data_arg, "val", data_lib.read_meta(data_arg, cfg.model.vocab_size))
    else:
        tokens = data_lib.load_tokens(data_arg)
    if int(tokens.max()) >= cfg.model.vocab_size:
        raise ConfigError(f"data={data_arg!r} holds token id {int(tokens.max())} >= model.vocab_size="
                          f"{cfg.model.vocab_size}")
    T = cfg.train.seq_len
    xs, ys = data_lib.eval_windows(tokens, T, cfg.eval.windows)
    _devices_for(cfg)
    import jax

    cfg = _eval_batch(cfg, len(xs))

    from jaxpar.run import infer
    from jaxpar.run.evaluation import mean_loss

    runner = infer.build_runner(cfg)
    params = runner.load(ckpt, hf_params)
    B = runner.cfg.train.batch_size
    total, n = mean_loss(runner.nll, runner.put, params, ((xs[i:i + B], ys[i:i + B]) for i in range(0, len(xs), B)), B)
    loss = total / n
    if not math.isfinite(loss):
        raise ConfigError(f"the loss of {ckpt or hf_dir!r} on data={data_arg!r} is {loss}: the weights are not usable")
    if jax.process_index() == 0:
        print(json.dumps({"loss": loss, "perplexity": math.exp(loss), "tokens": n}))
    return 0


def _eval_batch(cfg: C.Config, windows: int) -> C.Config:
    """eval pads its last batch to train.batch_size rows: a batch never has more rows than the
    windows need, rounded up to a multiple of the rows the mesh takes (train.batch_size=100000
    on 5 windows padded them to tens of gigabytes). Devices must be set up."""
    import jax

    from jaxpar.parallel.layout import min_batch_rows
    from jaxpar.parallel.mesh import resolve_mesh_config

    rows = min_batch_rows(resolve_mesh_config(cfg.mesh, jax.device_count()), cfg.pipeline.microbatches)
    need = -(-windows // rows) * rows
    if cfg.train.batch_size <= need:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=need))


SAMPLE_KEYS = O.names(O.SampleOptions)


def sample(argv: list[str]) -> int:
    """Generate from a run dir on one device, or on the mesh given by `mesh.*` / `pipeline.*`."""
    kv = parse_kv(argv, once=O.ONCE_KEYS["sample"])
    opts = {k: v for k, v in kv.items() if k in SAMPLE_KEYS}
    over = {k: v for k, v in kv.items() if k not in SAMPLE_KEYS}
    unknown = [k for k in over if not (k.startswith(("mesh.", "pipeline.")) or k == "precision")]
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(unknown))} (valid: {', '.join(sorted(SAMPLE_KEYS))}, "
                          f"mesh.*, pipeline.*, precision)")
    if not opts.get("checkpoint"):
        raise ConfigError("sample needs checkpoint=<run dir>")
    base, _ = _inference_base(opts["checkpoint"], "")
    cfg = C.resolve_kv(over, None, base)
    from jaxpar.run.sample import run_sample

    return run_sample(opts, cfg)


def convert(argv: list[str]) -> int:
    from gpt2common import hf

    kv = parse_kv(argv, once=True)
    from gpt2common.outdir import check_writable

    if set(kv) == {"hf", "out"}:
        from gpt2common.outdir import check_free, entries, hold
        from jaxpar.run.checkpoint import Checkpointer

        check_writable(kv["out"], "out")
        check_free(kv["out"])  # a run that just took it writes there next
        if os.path.isdir(kv["out"]) and entries(kv["out"]):  # a killed run's stale lock file is nothing
            raise ConfigError(f"out={kv['out']!r} is not empty")
        mc, params = hf.load_hf(kv["hf"], "hf")
        # a model with fewer positions than the default window gets a window it can run (sample, eval)
        train = C.TrainConfig(seq_len=min(C.TrainConfig.seq_len, mc.n_positions))
        # init= recorded absolute (config.absolute_paths): sample reads the tokenizer files there from any dir
        cfg = C.absolute_paths(C.Config(model=mc, model_name=f"hf:{kv['hf']}", init=kv["hf"], out=kv["out"],
                                        train=train), None)
        lock = hold(kv["out"])  # a writer like train: one at a time
        try:
            with open(os.path.join(kv["out"], "config.json"), "w") as f:
                f.write(C.dumps(cfg))
            ck = Checkpointer(kv["out"])
            ck.save(0, {"params": params}, {"step": 0, "seed": cfg.seed, "source": kv["hf"]})
            ck.close()
        finally:
            lock.release()
        print(f"converted {kv['hf']} -> {kv['out']} ({mc.num_params():,} params)")
        return 0
    if set(kv) == {"checkpoint", "to_hf"}:
        from jaxpar.run.export import check_target, export_hf

        check_target(kv["to_hf"])
        ckpt = kv["checkpoint"]
        names = export_hf(ckpt, kv["to_hf"], run_config(ckpt), lambda: load_model(ckpt)[1])
        print(f"exported {kv['checkpoint']} -> {kv['to_hf']} ({', '.join(names)})")
        return 0
    if set(kv) in ({"checkpoint", "to_state"}, {"checkpoint", "to_state", "step"}):
        from gpt2common.grammar import parse_value
        from gpt2common.state import check_target
        from jaxpar.run.handoff import export_state

        step = parse_value(int, kv.get("step", 0), "step")
        if step < 0:
            raise ConfigError(f"step={step} must be >= 0 (0: the newest checkpoint)")
        check_target(kv["to_state"], "to_state")
        m = export_state(kv["checkpoint"], kv["to_state"], run_config(kv["checkpoint"]), step or None)
        print(f"exported {kv['checkpoint']} step {m['step']} -> {kv['to_state']} (training state)")
        return 0
    raise ConfigError(f"convert takes hf=DIR out=DIR, checkpoint=DIR to_hf=DIR or checkpoint=DIR to_state=DIR [step=K] (got {', '.join(sorted(kv)) or 'nothing'})")


def plot(argv: list[str]) -> int:
    from jaxpar.run.plot import plot_run

    kv = parse_kv(argv, once=True)
    if set(kv) - set(O.names(O.PlotOptions)) or "run" not in kv:
        raise ConfigError("plot takes run=<run dir> [out=<png>]")
    path = plot_run(kv["run"], kv.get("out"))
    print(path)
    return 0


def mesh(argv: list[str]) -> int:
    cfg = _parse(argv)
    _devices_for(cfg)
    from jaxpar.parallel import mesh as mesh_lib

    print(mesh_lib.describe(mesh_lib.build_mesh(cfg.mesh)))
    return 0


if __name__ == "__main__":
    sys.exit(train(sys.argv[1:]))
