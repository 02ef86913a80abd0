"""Plans as JSON, and plans -> `jaxpar train` config overrides.

A plan file holds what it was made for (devices, device kind, model, batch, seq_len,
precision), the chosen strategy with its predicted figures, and the runners-up:

  {"version": 1, "devices": 64, "device": "h100", "model": {...}, "batch_size": 512, ...,
   "mesh": {"data": 8, "fsdp": 8, "tensor": 1, "pipe": 1}, "memory_per_device_bytes": ...,
   "step_time_s": ..., "mfu": ..., "strategy": {...}, "candidates": [{same fields}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.planner.cost import GROUPS, Estimate, Strategy, Workload

PLAN_VERSION = 1


def summary(e: Estimate) -> dict[str, Any]:
    """JSON-ready figures of one estimate (the fields `--json` promises, and more)."""
    s = e.strategy
    return {
        "mesh": s.mesh,
        "microbatches": s.microbatches,
        "repeats": s.repeats,
        "schedule": s.schedule,
        "layers_per_stage": list(e.layers_per_stage),
        "remat": s.remat,
        "osdp": {g: ("sharded" if s.fsdp > 1 and g not in s.replicated else "replicated") for g in GROUPS},
        "vocab_chunks": s.vocab_chunks,
        "mlp_chunks": s.mlp_chunks,
        "gather": s.gather,
        "sequence_parallel": s.seq_parallel,
        "memory_per_device_bytes": int(e.memory["total"]),
        "memory_breakdown_bytes": {k: int(v) for k, v in e.memory.items() if k != "total"},
        "step_time_s": e.step_time_s,
        "compute_s": e.compute_s,
        "comm_s": e.comm_s,
        "comm_bytes": {k: int(v) for k, v in e.comm_bytes.items()},
        # each collective: seconds (before DP/FSDP overlap) and bytes sent per device per step
        "collectives": {k: {"seconds": v[0], "bytes": int(v[1])} for k, v in e.collectives.items()},
        "traffic_s": e.traffic_s,
        "bubble": e.bubble,
        "mfu": e.mfu,
        "tokens_per_s": e.tokens_per_s,
    }


def strategy_from_summary(d: dict[str, Any]) -> Strategy:
    mesh = d["mesh"]
    rep = tuple(g for g in GROUPS if d.get("osdp", {}).get(g) == "replicated" and mesh["fsdp"] > 1)
    return Strategy(mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["pipe"], d["microbatches"], d["repeats"],
                    d["remat"], rep, d.get("vocab_chunks", 1), d.get("mlp_chunks", 1),
                    gather=d.get("gather", "step"), schedule=d.get("schedule", "gpipe"),
                    seq_parallel=d.get("sequence_parallel", False))


@dataclass(frozen=True)
class Plan:
    """A loaded or freshly made plan. `data` is the JSON object; the properties read it."""

    data: dict[str, Any]

    @property
    def devices(self) -> int:
        return int(self.data["devices"])

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.data["mesh"])

    @property
    def strategy(self) -> Strategy:
        return strategy_from_summary(self.data)

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(**self.data["model"])

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2)


def make_plan(w: Workload, device: str, n_devices: int, memory_limit: float, ranked: list[Estimate],
              extra: dict[str, Any] | None = None) -> Plan:
    """Plan object from search results (`ranked[0]` is the choice)."""
    data: dict[str, Any] = {
        "version": PLAN_VERSION,
        "devices": n_devices,
        "device": device,
        "memory_limit_bytes": int(memory_limit),
        "model": dataclasses.asdict(w.model),
        "batch_size": w.batch_size,
        "seq_len": w.seq_len,
        "precision": w.precision,
        "attention": w.attention,
    }
    data.update(summary(ranked[0]))
    data["candidates"] = [summary(e) for e in ranked[1:]]
    data.update(extra or {})
    return Plan(data)


def plan_path(out: str) -> str:
    """Where `out=` puts the plan (a file, or a directory -> out/plan.json), after the checks that
    keep it from destroying anything: a run dir is never written into (a run's files are its own)
    and an existing file is replaced only when it is itself a jaxpar plan. Writes nothing."""
    path = os.path.join(out, "plan.json") if out.endswith(os.sep) or os.path.isdir(out) else out
    folder = os.path.dirname(path) or "."
    held = [f for f in ("config.json", "ckpt", "metrics.jsonl") if os.path.exists(os.path.join(folder, f))]
    if held:
        raise ConfigError(f"out={out!r}: {folder!r} is a run dir (holds {', '.join(held)}); "
                          "write the plan somewhere else")
    if os.path.lexists(path):
        try:
            load_plan(path)
        except (ConfigError, OSError, UnicodeDecodeError):
            raise ConfigError(f"out={out!r}: {path!r} exists and is not a jaxpar plan; "
                              "choose another out or move it away") from None
    return path


def save_plan(plan: Plan, out: str) -> str:
    """Write plan JSON to `out` (see `plan_path` for what is refused). Returns the path."""
    path = plan_path(out)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(plan.to_json() + "\n")
    return path


def load_plan(path: str) -> Plan:
    """Read a plan.json; ConfigError (one line) when missing or malformed."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"plan={path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"plan={path!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # json recurses per level
        raise ConfigError(f"plan={path!r} is not valid JSON (nested past the parser's depth)") from None
    # any JSON value may stand there: `k in 5` was a TypeError traceback, `k in "..."` a substring test
    missing = [k for k in ("devices", "mesh", "microbatches", "repeats", "remat", "model", "batch_size", "seq_len",
                           "precision") if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"plan={path!r} is not a jaxpar plan (missing {', '.join(missing)})")
    return Plan(data)


def plan_to_overrides(plan: Plan, n_devices: int, cfg=None) -> dict[str, str]:
    """Config overrides (dotted key -> string) that make `jaxpar train` run `plan`.

    Refuses (ConfigError) a plan made for another device count, for another model / batch /
    seq_len / precision than `cfg` (a jaxpar.config.Config, optional), or one whose splitting
    train cannot run (vocab_chunks not dividing seq_len, mlp_chunks not dividing 4·n_embd).
    Remat (none|selective|full), op splitting (train.vocab_chunks / train.mlp_chunks) and
    per-group OSDP (sharding.replicate) all apply. A plan whose groups are all replicated over
    fsdp is the same as plain data parallelism, so fsdp folds into data.
    """
    if plan.devices != n_devices:
        raise ConfigError(f"plan was made for devices={plan.devices}, but {n_devices} devices are available "
                          f"(re-run `jaxpar plan devices={n_devices}` or use plan=auto)")
    d = plan.data
    if cfg is not None:
        want = {**{f"model.{k}": v for k, v in d["model"].items() if k in ("n_layer", "n_embd", "n_head",
                                                                              "vocab_size", "n_positions")},
                "train.batch_size": d["batch_size"], "train.seq_len": d["seq_len"], "precision": d["precision"]}
        have = {**{f"model.{k}": getattr(cfg.model, k.split(".")[0]) for k in ("n_layer", "n_embd", "n_head",
                                                                                 "vocab_size", "n_positions")},
                "train.batch_size": cfg.train.batch_size, "train.seq_len": cfg.train.seq_len,
                "precision": cfg.precision}
        diff = [f"{k}={want[k]} (config has {have[k]})" for k in want if want[k] != have[k]]
        if diff:
            raise ConfigError(f"plan was made for {', '.join(diff)}")
    s = plan.strategy
    if s.remat not in ("none", "selective", "full"):
        raise ConfigError(f"plan uses remat={s.remat!r}; jaxpar train supports remat=none|selective|full")
    D = d["model"]["n_embd"]
    if d["seq_len"] % s.vocab_chunks or (4 * D) % s.mlp_chunks:
        raise ConfigError(f"plan uses vocab_chunks={s.vocab_chunks}, mlp_chunks={s.mlp_chunks}; jaxpar train needs "
                          f"them to divide seq_len={d['seq_len']} and 4*n_embd={4 * D}")
    data, fsdp = s.data, s.fsdp
    replicated = tuple(g for g in GROUPS if g in s.replicated)
    if fsdp > 1 and len(replicated) == len(GROUPS):
        data, fsdp, replicated = data * fsdp, 1, ()
    out = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": s.tensor, "mesh.pipe": s.pipe,
           "train.remat": s.remat, "train.vocab_chunks": s.vocab_chunks, "train.mlp_chunks": s.mlp_chunks,
           "sharding.replicate": ",".join(replicated if fsdp > 1 else ()),
           "tensor.sequence_parallel": str(s.seq_parallel).lower()}
    if s.pipe > 1:
        out.update({"pipeline.microbatches": s.microbatches, "pipeline.repeats": s.repeats,
                    "pipeline.schedule": s.schedule, "train.grad_accum": 1,
                    "pipeline.gather": s.gather})
        if s.repeats == 1 and d.get("layers_per_stage"):
            out["pipeline.layers_per_stage"] = "[" + ",".join(str(x) for x in d["layers_per_stage"]) + "]"
    else:
        out.update({"train.grad_accum": s.microbatches, "pipeline.microbatches": 1, "pipeline.repeats": 1})
    return {k: str(v) for k, v in out.items()}


def fmt_bytes(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def memory_parts(e: Estimate) -> str:
    """'activations 90.30 GiB, optimizer 17.70 GiB, ...', largest part first."""
    parts = sorted(((k, v) for k, v in e.memory.items() if k != "total"), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts)


def plan_for(w: Workload, n_devices: int, device: str = "h100", memory_limit: float | None = None,
             device_overrides: dict[str, str] | None = None, space=None, top_k: int = 8, fixed=None):
    """Search and wrap the result in a Plan -> (plan, SearchResult).

    `fixed` (search.Fixed): values the plan must keep; the rest is searched. Raises ConfigError
    naming the fixed values no mesh can realise, or, when nothing fits `memory_limit` (default:
    the device's memory), the smallest per-device memory any plan needs and its largest parts."""
    from jaxpar.planner.devices import get_device
    from jaxpar.planner.search import Fixed, SearchSpace, check_fixed, search

    fixed = fixed or Fixed()
    dev = get_device(device, device_overrides)
    limit = dev.memory if memory_limit is None else memory_limit
    shown = " ".join(f"{k}={v}" for k, v in fixed.items().items())
    why = check_fixed(w, n_devices, fixed)
    if why:
        raise ConfigError(why)
    res = search(w, n_devices, dev, limit, space or SearchSpace(), top_k, fixed)
    if res.meshes == 0 or res.lightest is None:
        keep = f" with {shown}" if shown else ""
        raise ConfigError(f"devices={n_devices} has no mesh{keep} that divides train.batch_size={w.batch_size} "
                          f"and the model's dims (model.n_embd={w.model.n_embd}, model.n_head={w.model.n_head}, "
                          f"model.n_layer={w.model.n_layer})")
    if not res.ranked:
        what = f"{shown} needs" if res.evaluated == 1 and shown else "the smallest per-device memory any plan needs is"
        raise ConfigError(f"no plan fits memory_limit={fmt_bytes(limit)} on {n_devices} × {device}: {what} "
                          f"{fmt_bytes(res.min_memory)} ({int(res.min_memory)} bytes) per device: "
                          f"{memory_parts(res.lightest)}")
    extra = {"search": {"evaluated": res.evaluated, "meshes": res.meshes, "seconds": round(res.seconds, 3)},
             "fixed": fixed.items()}
    return make_plan(w, device, n_devices, limit, res.ranked, extra), res


def plan_auto(cfg, n_devices: int, device: str = "cpu", memory_limit: float | None = None) -> Plan:
    """`jaxpar train plan=auto`: best plan for `cfg` (a Config) on n_devices, over the full search
    space (train runs every remat / op-splitting / OSDP option the planner searches)."""
    from jaxpar.planner.search import SearchSpace

    w = Workload(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.precision)
    # pipeline.schedule=1f1b has no dropout (jaxpar.parallel.layout refuses it): not offered with dropout
    return plan_for(w, n_devices, device, memory_limit, space=SearchSpace(one_f_one_b=cfg.model.dropout == 0))[0]
