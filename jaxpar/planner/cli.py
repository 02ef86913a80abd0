"""`jaxpar plan [key=value ...] [--json]`: search the parallel plan space, print, write plan.json.

Keys: model=<preset>, model.<field>, train.batch_size, train.seq_len, precision=bf16|fp32,
devices=N, device=<cpu|a100-40g|a100-80g|h100|h200>, device.<field>=<value> (peak_flops,
peak_flops_fp32, memory, bandwidth, inter_bandwidth, latency, node_size, efficiency, overlap),
memory_limit=16GB (default: the device's memory), out=plan.json (file or dir/),
sweep=8,16,...,1024 (PNG of predicted throughput and MFU vs devices), top=N rows,
space=full|train (train: only what `jaxpar train` applies today), attention=naive|flash.
Fixed values (the keys `jaxpar train` takes; the search keeps them and chooses the rest):
mesh.data|fsdp|tensor|pipe (-1: searched), pipeline.microbatches|schedule|repeats|gather (pipe > 1),
train.grad_accum, train.remat, train.vocab_chunks|mlp_chunks, sharding.replicate,
tensor.sequence_parallel. With all of
them fixed, `jaxpar plan` evaluates that one configuration (a what-if): the breakdown below the
table, or one `error:` line naming the resource it exceeds.
Exit 0 on success, 2 with one line `error: ...` on stderr for invalid input or when no plan fits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from gpt2common.grammar import one_line, parse_kv, setting
from jaxpar.config import Config, ConfigError, apply_overrides, validate
from jaxpar.parallel.layout import one_f_one_b_problem
from jaxpar.planner.cost import Workload
from jaxpar.planner.devices import DEVICES, parse_bytes
from jaxpar.planner.plan import fmt_bytes, plan_for, plan_path, save_plan
from jaxpar.planner.search import TRAIN_SUPPORTED, Fixed, SearchSpace

USAGE = "usage: jaxpar plan [model=<preset>] [devices=N] [device=h100] [train.batch_size=B] ... [--json]"
CONFIG_KEYS = ("model", "train.batch_size", "train.seq_len", "precision")
# keys `jaxpar train` takes that fix part of the plan (Fixed field each one sets)
FIXED_KEYS = {"mesh.data": "data", "mesh.fsdp": "fsdp", "mesh.tensor": "tensor", "mesh.pipe": "pipe",
              "pipeline.microbatches": "microbatches", "pipeline.schedule": "schedule",
              "pipeline.repeats": "repeats", "train.grad_accum": "grad_accum", "train.remat": "remat",
              "train.vocab_chunks": "vocab_chunks", "train.mlp_chunks": "mlp_chunks",
              "sharding.replicate": "replicate", "pipeline.gather": "gather",
              "tensor.sequence_parallel": "sequence_parallel"}


@dataclass(frozen=True)
class PlanOptions:
    """The planner's own keys (`jaxpar plan --help` prints them; `parse_args` reads them)."""

    devices: int = setting(8, "devices to plan for")
    device: str = setting("h100", "device table row: " + " | ".join(DEVICES))
    memory_limit: str = setting("", "bytes per device the plan may use (16GB, 40GiB); empty: the device's memory")
    out: str = setting("plan.json", "where plan.json goes (a file, or a dir ending in /)")
    sweep: str = setting("", "device counts, e.g. 8,16,32: PNG of predicted tokens/s and MFU against them")
    top: int = setting(5, "candidate rows printed")
    space: str = setting("full", "full | train (only what jaxpar train applies today)")
    attention: str = setting("naive", "attention memory model: naive | flash")


PLAN_KEYS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def _int(raw: str, key: str, lo: int = 1) -> int:
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None
    if v < lo:
        raise ConfigError(f"{key}={v} must be >= {lo}")
    return v


def parse_args(argv: list[str]) -> dict:
    """argv (without the word 'plan') -> settings dict; ConfigError on anything invalid."""
    flags = [a for a in argv if a.startswith("--")]
    for fl in flags:
        if fl not in ("--json",):
            raise ConfigError(f"unknown flag {fl!r} (valid: --json)")
    kv = parse_kv([a for a in argv if not a.startswith("--")], once=PLAN_KEYS)  # out= twice: refused
    cfg_items, dev_over, opts = {}, {}, {}
    for k, v in kv.items():
        if k in CONFIG_KEYS or k in FIXED_KEYS or k.startswith("model."):
            cfg_items[k] = v
        elif k.startswith("device."):
            dev_over[k[len("device."):]] = v
        elif k in PLAN_KEYS:
            opts[k] = v
        else:
            raise ConfigError(f"unknown key {k!r} (valid: model, model.*, {', '.join(CONFIG_KEYS[1:])}, "
                              f"device.*, {', '.join(PLAN_KEYS)}, {', '.join(FIXED_KEYS)})")
    # fixed keys go through train's own parsing and validation (same types, same messages)
    cfg = validate(apply_overrides(Config(), cfg_items))
    fixed = {}
    for key, name in FIXED_KEYS.items():
        if key in cfg_items:
            section, field = key.split(".")
            v = getattr(getattr(cfg, section), field)
            if section == "mesh" and v == -1:
                continue  # -1: the search fills this axis
            fixed[name] = tuple(v) if isinstance(v, (list, tuple)) else v
    if fixed.get("schedule") == "1f1b" and cfg.model.dropout > 0:
        raise ConfigError(one_f_one_b_problem(cfg))  # the line jaxpar train gives
    space = opts.get("space", str(PlanOptions.space))
    if space not in ("full", "train"):
        raise ConfigError(f"space={space!r} must be full or train")
    attention = opts.get("attention", str(PlanOptions.attention))
    if attention not in ("naive", "flash"):
        raise ConfigError(f"attention={attention!r} must be naive or flash")
    sweep = []
    if opts.get("sweep"):
        sweep = [_int(x, "sweep") for x in opts["sweep"].replace(" ", "").split(",") if x]
    return {
        "cfg": cfg,
        "json": "--json" in flags,
        "devices": _int(opts.get("devices", str(PlanOptions.devices)), "devices"),
        "device": opts.get("device", str(PlanOptions.device)),
        "device_overrides": dev_over,
        "memory_limit": parse_bytes(opts["memory_limit"]) if "memory_limit" in opts else None,
        "out": opts.get("out", str(PlanOptions.out)),
        "sweep": sweep,
        "top": _int(opts.get("top", str(PlanOptions.top)), "top"),
        # pipeline.schedule=1f1b has no dropout (jaxpar.parallel.layout refuses it): not searched with dropout
        "space": dataclasses.replace(TRAIN_SUPPORTED if space == "train" else SearchSpace(),
                                     one_f_one_b=cfg.model.dropout == 0),
        "attention": attention,
        "fixed": Fixed(**fixed),
    }


def _mesh_str(m: dict) -> str:
    return "×".join(str(m[k]) for k in ("data", "fsdp", "tensor", "pipe"))


def print_table(rows: list[dict], title: str) -> None:
    """Top candidates, one row each (rich when stdout is a terminal, plain text otherwise)."""
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title, title_justify="left")
    for col in ("#", "mesh d×f×t×p", "params (embed/attn/mlp)", "M", "R", "SP", "remat", "split v/mlp",
                "memory", "step s", "MFU", "bubble"):
        tab.add_column(col, justify="right" if col not in ("mesh d×f×t×p", "params (embed/attn/mlp)") else "left")
    for i, r in enumerate(rows):
        osdp = "/".join("Z3" if r["osdp"][g] == "sharded" else "rep" for g in ("embed", "attn", "mlp"))
        tab.add_row(str(i + 1), _mesh_str(r["mesh"]), osdp, str(r["microbatches"]),
                    r["schedule"] if r.get("schedule") in ("1f1b", "zb") else
                    f"{r['repeats']} il" if r.get("schedule") == "interleaved" else str(r["repeats"]),
                    "on" if r.get("sequence_parallel") else "", r["remat"],
                    f"{r['vocab_chunks']}/{r['mlp_chunks']}", fmt_bytes(r["memory_per_device_bytes"]),
                    f"{r['step_time_s']:.4g}", f"{100 * r['mfu']:.1f}%", f"{100 * r['bubble']:.1f}%")
    Console(width=160).print(tab)


def print_breakdown(b: dict) -> None:
    """Per-device, per-step breakdown of one plan summary: memory by part, compute, each
    collective's time and bytes (DP/FSDP ones partly hidden by the device's overlap), bubble, MFU."""
    mem = b["memory_breakdown_bytes"]
    print("breakdown (per device, per step):")
    print("  memory   " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items())
          + f" = {fmt_bytes(b['memory_per_device_bytes'])}")
    print(f"  compute  {b['compute_s']:.4g} s (pipeline bubble {100 * b['bubble']:.1f}% of it)"
          + (f", elementwise traffic {b['traffic_s']:.4g} s" if b.get("traffic_s") else ""))
    for name, c in sorted(b["collectives"].items(), key=lambda kv: -kv[1]["seconds"]):
        print(f"  {name:<24} {c['seconds']:.4g} s, {fmt_bytes(c['bytes'])} sent")
    exposed = ", ".join(f"{k} {v:.4g} s" for k, v in b["comm_s"].items() if v)
    print(f"  step     {b['step_time_s']:.4g} s = compute + traffic + tensor/pipe + unhidden data/fsdp "
          f"(totals: {exposed or 'no communication'}); MFU {100 * b['mfu']:.1f}%")


def run(opts: dict) -> int:
    cfg = opts["cfg"]
    plan_path(opts["out"])  # refused before the search, and before a sweep's PNG is written next to it
    w = Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.precision, opts["attention"])
    plan, res = plan_for(w, opts["devices"], opts["device"], opts["memory_limit"], opts["device_overrides"],
                         opts["space"], top_k=max(opts["top"], 2), fixed=opts["fixed"])
    sweep_points = []
    for n in opts["sweep"]:
        try:
            p, _ = plan_for(w, n, opts["device"], opts["memory_limit"], opts["device_overrides"], opts["space"], 2,
                            opts["fixed"])
        except ConfigError as e:  # some counts may not fit or not divide the batch: leave a gap
            sweep_points.append({"devices": n, "error": str(e)})
            continue
        sweep_points.append({"devices": n, "mesh": p.mesh, "tokens_per_s": p.data["tokens_per_s"],
                             "mfu": p.data["mfu"], "step_time_s": p.data["step_time_s"]})
    if sweep_points and all("error" in p for p in sweep_points):  # nothing to plot: refused, nothing written
        why = "; ".join(f"devices={p['devices']}: {p['error']}" for p in sweep_points)
        raise ConfigError(f"sweep={','.join(map(str, opts['sweep']))}: no device count has a plan ({why})")
    try:  # an unwritable or misplaced out= is bad input: one error line, not a traceback
        return _write_and_print(plan, res, sweep_points, opts, cfg, w)
    except OSError as e:
        where = f": {e.filename!r}" if e.filename else ""
        raise ConfigError(f"out={opts['out']!r} cannot be written ({e.strerror or e}{where})") from None


def _write_and_print(plan, res, sweep_points, opts, cfg, w) -> int:
    if sweep_points:
        from jaxpar.planner.plot import plot_sweep

        ok = [p for p in sweep_points if "error" not in p]
        png = os.path.join(os.path.dirname(opts["out"]) if not opts["out"].endswith(os.sep) else opts["out"],
                           "plan_sweep.png")
        os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
        plot_sweep(ok, png, f"{cfg.model_name} B={w.batch_size} T={w.seq_len} on {opts['device']}")
        plan.data["sweep"] = sweep_points
        plan.data["sweep_png"] = png
    path = save_plan(plan, opts["out"])
    if opts["json"]:
        print(json.dumps(plan.data))
        return 0
    rows = [plan.data] + plan.data["candidates"]
    print_table(rows[: opts["top"]], f"{cfg.model_name} · devices={opts['devices']} × {opts['device']} · "
                                     f"B={w.batch_size} T={w.seq_len} {w.precision} · memory limit "
                                     f"{fmt_bytes(plan.data['memory_limit_bytes'])}")
    b = plan.data
    print(f"chosen: mesh {_mesh_str(b['mesh'])} (data×fsdp×tensor×pipe), {b['tokens_per_s']:.4g} tokens/s, "
          f"MFU {100 * b['mfu']:.1f}%, {fmt_bytes(b['memory_per_device_bytes'])}/device")
    print_breakdown(b)
    fixed = " ".join(f"{k}={v}" for k, v in b.get("fixed", {}).items())
    print(f"searched {res.evaluated} strategies over {res.meshes} meshes in {res.seconds:.2f} s"
          f"{' keeping ' + fixed if fixed else ''}; wrote {path}")
    for p in sweep_points:
        if "error" in p:
            print(f"sweep devices={p['devices']}: {p['error']}")
        else:
            print(f"sweep devices={p['devices']}: mesh {_mesh_str(p['mesh'])} {p['tokens_per_s']:.4g} tokens/s "
                  f"MFU {100 * p['mfu']:.1f}%")
    if sweep_points:
        print(f"wrote {plan.data['sweep_png']}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point for `jaxpar plan`; argv excludes the word 'plan'. Returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(__doc__)
        return 0
    try:
        return run(parse_args(argv))
    except ConfigError as e:
        sys.stderr.write(f"error: {one_line(str(e))}\n")  # one write, one line (as jaxpar.cli)
        return 2


if __name__ == "__main__":  # python -m jaxpar.planner.cli ...
    sys.exit(main(sys.argv[1:]))
