"""`jaxpar --help` and `jaxpar <command> --help`: every key a command accepts, with its type,
default and one line of meaning, read from the dataclasses the command parses its keys into
(`jaxpar.config`, `jaxpar.run.options`, the planner's `PlanOptions` and `DeviceSpec`). The
meaning is each field's `doc` metadata (`gpt2common.grammar.setting`), so a new key shows up
here as soon as it exists, and a key without a doc line fails tests/test_help.py.
No JAX: help is printed before any device exists.
"""

from __future__ import annotations

import dataclasses
import typing

from gpt2common.helptext import doc_of, rows
from gpt2common.helptext import table as _table
from jaxpar import config as C
from jaxpar.run import options as O

# command -> (arguments after `jaxpar <command>`, one line of what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("[--config FILE.yaml] [key=value ...]", "train GPT-2 and write a run directory (out=)"),
    "prepare": ("input=<files|folder|glob|dataset> out=<dir> [tokenizer=...] [workers=N]",
                "stream a corpus through tokenizer workers into token shards"),
    "eval": ("(checkpoint=<run dir> [data=<prepared dir | .bin>] | hf=<dir> data=<prepared dir | .bin>) [key=value ...]",
             "loss and perplexity of a run or an HF model on held-out tokens"),
    "sample": ("checkpoint=<run dir> [prompt=...] [key=value ...]", "generate text from a run"),
    "convert": ("hf=<dir> out=<run dir>  |  checkpoint=<run dir> to_hf=<dir>",
                "import HF GPT-2 weights as a run, or export a run for transformers"),
    "plot": ("run=<run dir> [out=<png>]", "PNG of a run's loss and tokens/s"),
    "mesh": ("[mesh.*=...]", "print devices, processes and the resolved mesh"),
    "launch": ("nprocs=N [port=P] [grace=S] -- <command ...>", "run N local processes as one job (CPU collectives)"),
    "inspect": ("[--config FILE.yaml] [key=value ...]",
                "compile the train step only; print memory and collective bytes (= train dry_run=true)"),
    "bisect": ("'RUN A' 'RUN B'  |  a='RUN A' b='RUN B'",
               "one step of two runs from the same weights and batch; name the first tensor where they part"),
    "plan": ("[key=value ...] [--json]", "choose mesh, stages, microbatches and remat from the cost model"),
}

RUNS = "run's"  # the default shown for a key whose value comes from the run being read


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxpar <command> [--config FILE.yaml] [key=value ...]", "       jaxpar --version", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`jaxpar <command> --help` lists the keys a command accepts, with types and defaults."]
    return "\n".join(lines)


def documented_classes() -> list[type]:
    """Every dataclass whose fields are keys of some command."""
    from jaxpar.planner import cli as plan_cli
    from jaxpar.planner.devices import DeviceSpec

    options = [O.PrepareOptions, O.EvalOptions, O.SampleOptions, O.ConvertOptions, O.PlotOptions, O.LaunchOptions,
               O.BisectOptions]
    return [C.Config, *C.SECTIONS.values(), *options, plan_cli.PlanOptions, DeviceSpec]


def undocumented(classes: list[type]) -> list[str]:
    """`Class.field` for each field with no doc line (sections of Config excepted: their fields
    are the keys)."""
    return [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
            if not doc_of(f).strip() and not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])]


def config_rows(cfg: C.Config | None = None) -> list[tuple[str, str, str, str]]:
    """Every `jaxpar train` key: `model` (the preset), then model.*, the other sections, the top keys."""
    cfg = cfg or C.Config()
    top = {f.name: f for f in dataclasses.fields(C.Config)}
    out = [("model", "str", cfg.model_name, doc_of(top["model_name"]))]
    for name, cls in C.SECTIONS.items():
        out += rows(cls, f"{name}.", getattr(cfg, name))
    out += rows(C.Config, "", cfg, skip=("model_name",))
    return out


def command_rows(cmd: str) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """(key rows, notes below the table) of `cmd`."""
    cfg = C.Config()
    if cmd in ("train", "inspect"):
        return config_rows(cfg), ["--config FILE.yaml: the same keys as YAML (sections as mappings); "
                                  "key=value arguments apply on top of it.",
                                  "resume=true starts from the run's own config.json; keys given apply on top."]
    if cmd == "prepare":
        return list(rows(O.PrepareOptions)), []
    if cmd in ("eval", "sample"):
        own = O.EvalOptions if cmd == "eval" else O.SampleOptions
        # eval's data= defaults to the run's own prepared data (jaxpar.run.commands._run_data)
        out = [(k, t, RUNS if (cmd, k) == ("eval", "data") else d, m) for k, t, d, m in rows(own)]
        out += rows(C.MeshConfig, "mesh.", cfg.mesh)
        out += rows(C.PipelineConfig, "pipeline.", default=RUNS)
        out += [("precision", "str", "fp32", doc_of(next(f for f in dataclasses.fields(C.Config)
                                                           if f.name == "precision")))]
        notes = ["The model and its settings come from the run's config.json; the keys above apply on top."]
        if cmd == "eval":
            out += rows(C.EvalConfig, "eval.", cfg.eval)
            out += rows(C.TrainConfig, "train.", only=("batch_size", "seq_len"), default=RUNS)
            notes.append("Any other `jaxpar train` key is accepted too (jaxpar train --help).")
        return out, notes
    if cmd == "convert":
        return list(rows(O.ConvertOptions)), ["Give either hf= and out=, checkpoint= and to_hf=, or checkpoint= and to_state= (step= optional)."]
    if cmd == "plot":
        return list(rows(O.PlotOptions)), []
    if cmd == "mesh":
        return list(rows(C.MeshConfig, "mesh.", cfg.mesh)), [
            "Any other `jaxpar train` key is accepted (and checked) too (jaxpar train --help)."]
    if cmd == "launch":
        return list(rows(O.LaunchOptions)), ["After `--`: the command each process runs, e.g. "
                                             "jaxpar launch nprocs=2 -- train mesh.data=4 ..."]
    if cmd == "plan":
        return _plan_rows(cfg)
    if cmd == "bisect":
        return list(rows(O.BisectOptions)), BISECT_NOTES
    raise KeyError(cmd)


BISECT_NOTES = [
    "RUN: 'jaxpar KEY=VALUE...' (any train key, mesh.* and pipeline.* included), 'torchref strategy=single "
    "[KEY=VALUE...]' or 'hf=DIR [KEY=VALUE...]'; torchref and hf sides take model, model.*, seed and train.*.",
    "Both start from the same weights (hf=DIR's, else the shared init of model and seed) and one batch of "
    "random ids (seed; train.batch_size=8, train.seq_len=32, train.warmup_steps=0, precision=fp32 unless given).",
    "The sides agree on the model's shape (a model key that sets another shape than hf=DIR's weights is refused); "
    "keys that set no shape (model.layer_norm_epsilon, model.attention) may differ, and are compared.",
    "Compared in model order: embeddings, each block's LayerNorms, attention probs and output, MLP pre/post "
    "activation, residual stream, logits, loss; then every gradient in backward order; then AdamW's moments and "
    "update. Names follow HF's module tree (transformer.h.0.attn.attn_weights, lm_head, ...).",
    "Prints tensor, shape, max abs, max rel, bound (jaxpar/tolerances.py), verdict, and the first tensor over "
    "its bound. Exit 0 clean, 1 when one is over, 2 on bad input.",
    "Example: jaxpar bisect 'jaxpar model=gpt2-tiny mesh.data=2 mesh.tensor=2' 'torchref strategy=single "
    "model=gpt2-tiny'",
]


def _plan_rows(cfg: C.Config):
    from jaxpar.planner import cli as plan_cli
    from jaxpar.planner.devices import DeviceSpec

    out = list(rows(plan_cli.PlanOptions))
    wanted = set(plan_cli.CONFIG_KEYS) | set(plan_cli.FIXED_KEYS)
    out += [r for r in config_rows(cfg) if r[0] in wanted or r[0].startswith("model.")]
    out += rows(DeviceSpec, "device.", skip=("name",), default="(row)")
    return out, ["device.* keys override the chosen device's table row (default: that row's value).",
                 "mesh.*, pipeline.*, train.* and sharding.* keys are kept fixed; the search chooses the rest.",
                 "--json: print the chosen plan as one JSON line."]


def command_help(cmd: str) -> str:
    args, what = COMMANDS[cmd]
    entries, notes = command_rows(cmd)
    text = [f"usage: jaxpar {cmd} {args}", "", what, "", "keys (type, default, meaning):", _table(entries)]
    if notes:
        text += [""] + notes
    return "\n".join(text)
