"""Compile-only inspection of the train step: per-device memory and collective bytes.

Reusable API (the planner validates its cost model against these):

    compiled, trainer = compile_step(cfg)            # jit(...).lower(abstract state).compile()
    mem = memory_per_device(compiled)                # from compiled.memory_analysis()
    coll = collective_bytes(compiled.as_text())      # parsed from the optimized HLO
    th = theory_bytes(cfg)                           # DP / ZeRO-3 / Megatron textbook figures

Collective bytes are *per device per optimizer step*. For each collective op the HLO gives
a payload S (bytes of the full, unsharded operand or result) and a group size n; we convert
it to bytes one device sends with the bandwidth-optimal ring algorithm, the same model the
textbook figures use:

    all-reduce       2(n-1)/n · S        (S = operand = result)
    all-gather        (n-1)/n · S        (S = gathered result)
    reduce-scatter    (n-1)/n · S        (S = operand before scattering)
    all-to-all        (n-1)/n · S
    collective-permute        S

Ops inside `while` bodies (the scanned layers, gradient accumulation) are multiplied by the
loop's known trip count, so a per-layer all-gather counts L times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def type_bytes(t: str) -> float:
    """Bytes of an HLO type string: `f32[128,512]{1,0}` or a tuple `(f32[2]{0}, bf16[4])`."""
    total = 0.0
    for dt, dims in _ARRAY_RE.findall(t):
        if dt.startswith("f8") or dt.startswith("f4"):
            size = 1
        elif dt in _DTYPE_BYTES:
            size = _DTYPE_BYTES[dt]
        else:
            continue
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """'(a, b) op(...)' -> ('(a, b)', 'op(...)'); 'f32[2]{0} op(...)' -> ('f32[2]{0}', 'op(...)')."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].strip()
    t, _, tail = rest.partition(" ")
    return t, tail.strip()


def _group_size(attrs: str, num_partitions: int) -> int:
    """Devices per group from `replica_groups=` in any of XLA's three spellings."""
    # the axes set may follow a device order: mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=1,'axis_1'=8] {'axis_1'}
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:  # iota form [num_groups, group_size]<=[...]
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:  # {{0,1,2,3},{4,5,6,7}}
        return len([x for x in m.group(1).split(",") if x.strip()])
    return num_partitions  # {} or absent: every device


def _wire(kind: str, payload: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * payload
    if kind == "collective-permute":
        return payload
    return (n - 1) / n * payload


def parse_hlo(hlo_text: str) -> dict:
    """Computations, instructions and call edges of an HLO module's text."""
    comps: dict[str, list[dict]] = {}
    types: dict[str, str] = {}
    entry, cur = None, None
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_partitions = int(m.group(1)) if m else 1
    for line in hlo_text.splitlines():
        if cur is None:
            cm = _COMP_RE.match(line)
            if cm and not line.startswith(" "):
                cur = cm.group(2)
                comps[cur] = []
                if cm.group(1):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        im = _INSTR_RE.match(line)
        if not im:
            continue
        name, rest = im.group(1), im.group(2)
        t, tail = _split_type(rest)
        op = tail.split("(", 1)[0].strip()
        # operands: the balanced (...) after the op name
        body = tail[len(op):]
        depth, end = 0, len(body)
        for i, ch in enumerate(body):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i > 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", body[:end + 1])
        attrs = body[end + 1:]
        types[name] = t
        comps[cur].append({"name": name, "type": t, "op": op, "operands": operands, "attrs": attrs})
    return {"computations": comps, "types": types, "entry": entry, "num_partitions": num_partitions}


def _callees(ins: dict) -> list[tuple[str, int | None]]:
    """(computation, trip multiplier or None for 'once per call') called by an instruction."""
    a = ins["attrs"]
    out = []
    if ins["op"] == "while":
        body = re.search(r"body=%?([\w.\-]+)", a)
        cond = re.search(r"condition=%?([\w.\-]+)", a)
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', a)
        n = int(trip.group(1)) if trip else None
        if body:
            out.append((body.group(1), n if n is not None else -1))
        if cond:
            out.append((cond.group(1), (n + 1) if n is not None else -1))
        return out
    for key in ("to_apply", "calls"):
        for c in re.findall(rf"{key}=%?([\w.\-]+)", a):
            out.append((c, 1))
    m = re.search(r"branch_computations=\{([^}]*)\}", a)
    if m:
        out += [(c, 1) for c in re.findall(r"%?([\w.\-]+)", m.group(1))]
    for key in ("true_computation", "false_computation"):
        for c in re.findall(rf"{key}=%?([\w.\-]+)", a):
            out.append((c, 1))
    return out


def collective_bytes(hlo_text: str) -> dict[str, Any]:
    """Collective traffic of one execution of an optimized HLO module, per device.

    Returns {kind: {"ops", "executions", "payload_bytes", "wire_bytes"}} for each kind in
    COLLECTIVES, plus "total_wire_bytes", "total_payload_bytes", "unknown_trip_counts" (while
    loops without a known trip count, counted once) and "ops" (one record per collective op).
    """
    mod = parse_hlo(hlo_text)
    comps, types, nparts = mod["computations"], mod["types"], mod["num_partitions"]
    # multiplier of each computation = how often it runs per execution of ENTRY
    mult: dict[str, float] = {}
    unknown = 0

    def visit(c: str, k: float, seen: tuple = ()):
        nonlocal unknown
        if c not in comps or c in seen:
            return
        mult[c] = mult.get(c, 0.0) + k
        for ins in comps[c]:
            callees = _callees(ins)
            unknown += any(n == -1 for _, n in callees)  # one loop (body and condition both unknown) counts once
            for callee, n in callees:
                visit(callee, k * (1 if n == -1 else n), seen + (c,))

    if mod["entry"]:
        visit(mod["entry"], 1.0)
    out: dict[str, Any] = {k: {"ops": 0, "executions": 0.0, "payload_bytes": 0.0, "wire_bytes": 0.0}
                           for k in COLLECTIVES}
    records = []
    for c, instrs in comps.items():
        k = mult.get(c, 0.0)
        for ins in instrs:
            op = ins["op"]
            kind = op[:-6] if op.endswith("-start") else op
            if kind not in COLLECTIVES or op.endswith("-done"):
                continue
            res = ins["type"]
            if op.endswith("-start") and res.startswith("("):
                # async start: ((operands), result, ...) -> take the result element
                res = _split_type(res[1:])[1].lstrip(", ").split(")")[0] if kind != "all-reduce" else res
            operand_bytes = sum(type_bytes(types.get(o, "")) for o in ins["operands"])
            result_bytes = type_bytes(res)
            payload = {"all-gather": result_bytes}.get(kind, operand_bytes or result_bytes)
            n = _group_size(ins["attrs"], nparts)
            if kind == "collective-permute":
                n = 2 if "source_target_pairs={}" not in ins["attrs"] else 1
            wire = _wire(kind, payload, n)
            d = out[kind]
            d["ops"] += 1
            d["executions"] += k
            d["payload_bytes"] += k * payload
            d["wire_bytes"] += k * wire
            meta = re.search(r'op_name="([^"]*)"', ins["attrs"])
            records.append({"name": ins["name"], "kind": kind, "group": n, "times": k, "payload_bytes": payload,
                            "wire_bytes": wire, "op_name": meta.group(1) if meta else ""})
    out["total_wire_bytes"] = sum(out[k]["wire_bytes"] for k in COLLECTIVES)
    out["total_payload_bytes"] = sum(out[k]["payload_bytes"] for k in COLLECTIVES)
    out["unknown_trip_counts"] = unknown
    out["ops"] = records
    return out


def memory_per_device(compiled) -> dict[str, int]:
    """Per-device bytes from `compiled.memory_analysis()`; `total` = arguments + outputs
    - aliased (donated state is reused in place) + temporaries."""
    ma = compiled.memory_analysis()
    get = lambda k: int(getattr(ma, k, 0) or 0)  # noqa: E731
    d = {"arguments": get("argument_size_in_bytes"), "outputs": get("output_size_in_bytes"),
         "aliased": get("alias_size_in_bytes"), "temp": get("temp_size_in_bytes"),
         "code": get("generated_code_size_in_bytes")}
    d["total"] = d["arguments"] + d["outputs"] - d["aliased"] + d["temp"]
    return d


# ----------------------------------------------------------------------------- theory


def theory_bytes(cfg) -> dict[str, float]:
    """Textbook per-device bytes per step for the mesh in `cfg` (sizes already resolved).

    Ψ_t = params after the tensor split, = Ψ_blocks (the L stacked layers) + Ψ_outer (wte
    (V/t, D), wpe (P, D), ln_f); S = pipe stages (1 without a pipeline); fp32 grads (4 bytes).

    dp:   ring all-reduce of the grads over `data`: 2(d-1)/d · Ψ_local · 4, Ψ_local = what one
          data replica reduces = Ψ_t / fsdp, blocks also / S (each stage reduces its own
          layers). With a pipeline the embedding rows are split over data·pipe too, so Ψ_outer
          is reduced over d·S devices: 2(dS-1)/(dS) · Ψ_outer/f · 4.
    fsdp: ZeRO-3 over `fsdp` (jaxpar.parallel.fsdp): each layer all-gathered in forward and
          again in backward, its grad reduce-scattered: 3(f-1)/f · Ψ_blocks · 4; wte/wpe/ln_f
          gathered once and kept (the head's backward follows its forward), reduce-scattered:
          2(f-1)/f · Ψ_outer · 4. In a pipeline a stage gathers its layers once per step
          (before the schedule's loop) and reduce-scatters their summed grads once:
          2(f-1)/f · Ψ_blocks/S · 4.
    tp:   Megatron: 4 all-reduces of (b, s, h) per layer per microbatch (2 forward, 2
          backward), plus the vocab-parallel embedding's output (forward) and the head's
          input grad (backward): (4L + 2) · 2(t-1)/t · b·s·h · bytes(activation) · microbatches,
          b = rows per data replica per microbatch.
    pipe: activations sent stage to stage: every iteration of the schedule's loop (N =
          n_iterations(S, M, R) = M + S - 1 for GPipe) each stage ppermutes one (b, s, h)
          microbatch forward, and its transpose sends the cotangent back in backward:
          2·N · b·s·h · bytes(activation). Plus the loop's ends: the embedded (B/(d·f), s, h)
          rows are all-gathered over pipe for stage 0 and stage S-1's outputs all-reduced back
          (fp32), each transposed in backward: 2 · (1 + 2)(S-1)/S · B/(d·f)·s·h · 4.
          1F1B, zb, interleaved (jaxpar.parallel.pipeline_exec): N = the packed plan's ticks
          (M + 2S - 2 for 1f1b and zb), each one (b, s, h) permute forward and one back; token
          ids go in, so no ends term.
    """
    from jaxpar.config import MeshConfig
    from jaxpar.parallel.sharding import local_shard_elements

    m, mc, tc = cfg.model, cfg.mesh, cfg.train
    d, f, t, S = mc.data, mc.fsdp, mc.tensor, mc.pipe
    psi = local_shard_elements(m, MeshConfig())
    psi_t = local_shard_elements(m, MeshConfig(tensor=t))
    outer = m.vocab_size * m.n_embd / t + m.n_positions * m.n_embd + 2 * m.n_embd  # wte, wpe, ln_f
    blocks = psi_t - outer
    act = 2 if cfg.precision == "bf16" else 4
    micro = tc.grad_accum * (cfg.pipeline.microbatches if S > 1 else 1)
    b = tc.batch_size // (d * f * micro)
    rows = tc.batch_size // (d * f * tc.grad_accum)  # per data replica per optimizer microstep
    unit = b * tc.seq_len * m.n_embd  # one microbatch's (b, s, h) activation elements
    ring = lambda n: (n - 1) / n  # noqa: E731
    out = {"params": float(psi), "params_per_tensor_shard": float(psi_t),
           "dp": 2.0 * ring(d) * blocks / (S * f) * 4 + 2.0 * ring(d * S) * outer / f * 4,
           "fsdp": ring(f) * 4 * ((3.0 if S == 1 else 2.0 / S) * blocks + 2.0 * outer),
           "tp": 2.0 * ring(t) * (4 * m.n_layer + 2) * unit * act * micro,
           "pipe": 0.0}
    if S > 1:
        from jaxpar.parallel.layout import TABLE_SCHEDULES
        from jaxpar.parallel.pipeline import n_iterations

        N = n_iterations(S, cfg.pipeline.microbatches, cfg.pipeline.repeats)
        ends = 2.0 * 3.0 * ring(S) * rows * tc.seq_len * m.n_embd * 4
        if cfg.pipeline.schedule in TABLE_SCHEDULES:  # the plan's ticks, one permute each way; no embedded rows
            from jaxpar.parallel.schedules import lockstep, make_table

            N = len(lockstep(make_table(cfg.pipeline.schedule, S, cfg.pipeline.microbatches, cfg.pipeline.repeats)))
            ends = 0.0
        out["pipe"] = (2.0 * N * unit * act + ends) * tc.grad_accum
    out["total"] = out["dp"] + out["fsdp"] + out["tp"] + out["pipe"]
    return out


# ----------------------------------------------------------------------------- compile


def compile_step(cfg, mesh=None, devices=None):
    """Compile the step training runs (`Trainer.loop_step_fn`, with its stop-flag all-reduce)
    for `cfg` without running it: returns (compiled, trainer).

    `cfg.mesh` may hold one -1; `mesh`/`devices` default to every device. Nothing is
    allocated: the state, batch and flag are abstract (`ShapeDtypeStruct`s with shardings)."""
    import jax
    import numpy as np

    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.train import build_trainer, resolve_layout

    if mesh is None:
        devices = jax.devices() if devices is None else list(devices)
    lay = resolve_layout(cfg, len(devices) if mesh is None else mesh.devices.size)  # one layout, validated once
    trainer = build_trainer(lay, mesh if mesh is not None else build_mesh(lay, devices))
    batch = jax.ShapeDtypeStruct((lay.cfg.train.batch_size, lay.cfg.train.seq_len), np.int32,
                                 sharding=trainer.batch_sharding)
    flag = jax.ShapeDtypeStruct((trainer.mesh.devices.size,), np.int32, sharding=trainer.flag_sharding)
    compiled = trainer.loop_step_fn.lower(trainer.abstract_state(), batch, batch, flag).compile()
    return compiled, trainer


def inspect_step(cfg, mesh=None, devices=None) -> dict[str, Any]:
    """compile_step + memory + collectives + theory, as one JSON-able dict."""
    compiled, trainer = compile_step(cfg, mesh, devices)
    coll = collective_bytes(compiled.as_text())
    th = theory_bytes(trainer.cfg)
    return {"mesh": dataclasses.asdict(trainer.cfg.mesh), "memory_per_device_bytes": memory_per_device(compiled),
            "collectives": {k: v for k, v in coll.items() if k != "ops"}, "theory": th,
            "ratio": coll["total_wire_bytes"] / th["total"] if th["total"] else None, "ops": coll["ops"],
            "warnings": list(trainer.layout.warnings)}


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f} MiB"


def format_report(cfg, info: dict) -> str:
    mem, coll, th = info["memory_per_device_bytes"], info["collectives"], info["theory"]
    mesh = "×".join(f"{k}={v}" for k, v in info["mesh"].items())
    tc = cfg.train
    lines = [f"inspect: {cfg.model_name} ({int(th['params']):,} params), mesh {mesh}, precision {cfg.precision}, "
             f"batch {tc.batch_size}×{tc.seq_len}, grad_accum {tc.grad_accum}",
             f"memory per device: total {_mib(mem['total'])} (arguments {_mib(mem['arguments'])}, outputs "
             f"{_mib(mem['outputs'])}, aliased {_mib(mem['aliased'])}, temp {_mib(mem['temp'])})",
             "collectives per step, per device (ring model):",
             f"  {'kind':<20}{'ops':>5}{'executions':>12}{'payload':>16}{'wire':>16}"]
    for k in COLLECTIVES:
        d = coll[k]
        if d["ops"]:
            lines.append(f"  {k:<20}{d['ops']:>5}{d['executions']:>12.0f}{_mib(d['payload_bytes']):>16}"
                         f"{_mib(d['wire_bytes']):>16}")
    lines.append(f"  {'total':<20}{'':>5}{'':>12}{_mib(coll['total_payload_bytes']):>16}"
                 f"{_mib(coll['total_wire_bytes']):>16}")
    parts = ", ".join(f"{k} {_mib(th[k])}" for k in ("dp", "fsdp", "tp", "pipe") if th[k])
    ratio = info["ratio"]
    lines.append(f"theory: {parts or 'no collectives (single device)'}; total {_mib(th['total'])}"
                 + (f"; measured/theory = {ratio:.3f}" if ratio is not None else ""))
    if coll["unknown_trip_counts"]:
        lines.append(f"note: {coll['unknown_trip_counts']} loop(s) without a known trip count were counted once")
    return "\n".join(lines)


def run_inspect(cfg) -> int:
    """`jaxpar inspect` / `jaxpar train dry_run=true`: compile, print, write nothing."""
    import jax

    info = inspect_step(cfg)
    if jax.process_index() == 0:
        for w in info["warnings"]:  # the layout's (e.g. a dominant pipeline bubble), as `jaxpar train` prints them
            print(w, file=sys.stderr)
        print(format_report(cfg, info))
        print(json.dumps({k: v for k, v in info.items() if k not in ("ops", "warnings")}, separators=(",", ":")))
    return 0
