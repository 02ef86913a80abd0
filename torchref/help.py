"""`torchref --help` and `torchref <command> --help`: every key a command takes, with its type, default
and one line of meaning, read from the dataclasses the command parses its keys into, as `jaxpar
<command> --help` is (`gpt2common.helptext`): `torchref.config.RefConfig` and its sections (torchref's
own keys), `torchref.run_config.RunConfig` (the `jaxpar train` keys torchref computes with) and
`torchref.compare.CompareOptions`. The `jaxpar train` keys torchref accepts but ignores or refuses are
named below the table, from `KEY_POLICY`. No torch: help is printed before anything starts.
"""

from __future__ import annotations

import dataclasses

from gpt2common.helptext import doc_of, rows, table
from torchref import config as RC
from torchref import run_config as R

# command -> (arguments after `torchref <command>`, one line of what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("[--config FILE.yaml] [key=value ...]",
              "train GPT-2 with one data-parallel strategy and write a run directory (out=)"),
    "compare": ("[workers=2,4] [strategies=a,b] [--config FILE.yaml] [key=value ...]",
                "run single, then every other strategy at each worker count, on one config: a table "
                "(markdown + JSON) and a PNG in out="),
}

Row = tuple[str, str, str, str]


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: torchref <command> [--config FILE.yaml] [key=value ...]", "       torchref --version", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`torchref <command> --help` lists the keys a command accepts, with types and defaults."]
    return "\n".join(lines)


def own_rows() -> list[Row]:
    """torchref's own keys (strategy, workers, ..., ps.async, horovod.*, ...) with their defaults."""
    ref = RC.RefConfig()
    out = list(rows(RC.RefConfig, "", ref))
    for name, cls in RC._SECTIONS.items():
        out += [(f"{name}.{RC._key(k.partition('.')[2])}", *rest) for k, *rest in rows(cls, f"{name}.", getattr(ref, name))]
    return out


def run_rows() -> list[Row]:
    """The `jaxpar train` keys torchref holds (KEY_POLICY mirrored), in jaxpar's order: model, model.*,
    train.*, then the top keys."""
    cfg = R.RunConfig()
    top = {f.name: f for f in dataclasses.fields(R.RunConfig)}
    model_keys = tuple(f.name for f in dataclasses.fields(cfg.model) if f"model.{f.name}" in R.HELD)
    out = [("model", "str", cfg.model_name, doc_of(top["model_name"]))]
    out += rows(type(cfg.model), "model.", cfg.model, only=model_keys)
    out += rows(R.TrainSettings, "train.", cfg.train)
    out += rows(R.RunConfig, "", cfg, skip=("model_name",))
    return out


def _policy_notes() -> list[str]:
    kinds = {k: kind for k, (kind, _) in R.KEY_POLICY.items() if k in R.IGNORED}
    ignored = [k for k, kind in kinds.items() if kind != "rejected"]
    refused = [k for k, kind in kinds.items() if kind == "rejected"]
    return [f"Accepted from `jaxpar train`, parsed and ignored (the same math, or output only): {', '.join(ignored)}.",
            f"Refused unless at jaxpar's default (torchref does not model them): {', '.join(refused)}."]


def command_rows(cmd: str) -> tuple[list[Row], list[str]]:
    """(key rows, notes below the table) of `cmd`."""
    config = "--config FILE.yaml: the same keys as YAML (sections as mappings); key=value arguments apply on top."
    if cmd == "train":
        return own_rows() + run_rows(), [config, *_policy_notes(), "Strategies, launch and outputs: torchref/README.md."]
    if cmd == "compare":
        from torchref.compare import CompareOptions

        # precision is set by each strategy (fp32, or the -amp ones' amp.dtype)
        per_run = [r for r in own_rows() + run_rows() if r[0] not in ("strategy", "workers", "out", "precision")]
        return list(rows(CompareOptions)) + per_run, [
            "The keys after out= are each run's (torchref train --help); strategy= is refused (compare runs every "
            "one) and precision= is each strategy's.",
            config, *_policy_notes()]
    raise KeyError(cmd)


def command_help(cmd: str) -> str:
    args, what = COMMANDS[cmd]
    entries, notes = command_rows(cmd)
    return "\n".join([f"usage: torchref {cmd} {args}", "", what, "", "keys (type, default, meaning):", table(entries),
                      "", *notes])
