"""The training-parity matrix: every jaxpar configuration and every torchref strategy, N steps
from one shared init on one prepared data set, compared with the PyTorch reference.

Reference: `torchref train strategy=single` (fp32). Per row:
  * loss trajectory: the `loss` of every step of `<out>/metrics.jsonl` (N = 10), relative diff;
  * step-1 gradient: the (averaged, pre-clip) gradient of the first global batch, per parameter.
    torchref rows save it with `debug.grad_step=1`; jaxpar's CLI does not dump gradients, so
    `python -m parity_tests.jax_grads` computes it in one process on 8 emulated CPU devices with
    the very mesh, shardings and loss function `jaxpar train` compiles (`build_trainer`,
    `make_loss_fn`), from the same HF init and the same batch;
  * grad-norm trajectory: the pre-clip global norm both CLIs log every step (`grad_norm`).

Everything runs through the public CLIs in subprocesses with a clean environment (each jaxpar run
emulates the devices its mesh needs), one at a time: the machines this runs on have 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from parity_tests.common import TINY, rel_inf, rel_l2, worst, write_data, write_init
from parity_tests.tolerances import TRAJECTORY

STEPS = 10
SEED = 0
# Shared by every row: gpt2-tiny, T=32, B=8 global, 10 steps, 2 warmup steps, lr 1e-3, clip 1.0.
COMMON = ["train.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2",
          "train.lr=1e-3", f"seed={SEED}"]


@dataclass(frozen=True)
class Row:
    name: str
    tool: str  # jaxpar | torchref
    args: tuple[str, ...]
    precision: str  # fp32 | bf16: which TRAJECTORY bounds apply
    mesh: dict = field(default_factory=dict)  # jaxpar: mesh sizes (for the gradient worker)
    pipeline: dict = field(default_factory=dict)


def _jx(name, precision="fp32", pipeline=None, **mesh):
    args = [f"mesh.{k}={v}" for k, v in mesh.items()] + [f"pipeline.{k}={v}" for k, v in (pipeline or {}).items()]
    return Row(name, "jaxpar", tuple(args + [f"precision={precision}"]), precision, dict(mesh), dict(pipeline or {}))


def _tr(strategy, workers=2):
    prec = "bf16" if strategy.endswith("-amp") else "fp32"
    return Row(f"torchref {strategy}" + (f" ×{workers}" if strategy != "single" else ""), "torchref",
               (f"strategy={strategy}", f"workers={1 if strategy == 'single' else workers}"), prec)


REFERENCE = _tr("single")
ROWS: list[Row] = [
    _jx("jaxpar single"),
    _jx("jaxpar data=8", data=8),
    _jx("jaxpar fsdp=8", fsdp=8),
    _jx("jaxpar tensor=4 data=2", data=2, tensor=4),
    _jx("jaxpar pipe=2 data=4 (gpipe mb=2)", data=4, pipe=2, pipeline={"microbatches": 2}),
    _jx("jaxpar data=2 fsdp=2 tensor=2", data=2, fsdp=2, tensor=2),
    _jx("jaxpar 3-D data=2 tensor=2 pipe=2", data=2, tensor=2, pipe=2, pipeline={"microbatches": 2}),
    _jx("jaxpar single bf16", "bf16"),
    _jx("jaxpar data=2 fsdp=2 tensor=2 bf16", "bf16", data=2, fsdp=2, tensor=2),
    _jx("jaxpar 3-D data=2 tensor=2 pipe=2 bf16", "bf16", data=2, tensor=2, pipe=2, pipeline={"microbatches": 2}),
    REFERENCE,
    _tr("single-ps"),
    _tr("distributed-ps"),
    _tr("horovod"),
    _tr("distributed-ps-amp"),
    _tr("horovod-amp"),
    # gradient accumulation (2 passes of B/4 rows per worker) against the reference's one pass
    dataclasses.replace(_tr("distributed-ps"), name="torchref distributed-ps ×2 grad_accum=2",
                        args=("strategy=distributed-ps", "workers=2", "train.grad_accum=2")),
    dataclasses.replace(_tr("horovod"), name="torchref horovod ×2 grad_accum=2",
                        args=("strategy=horovod", "workers=2", "train.grad_accum=2")),
]
# The default (fast) subset: the cross-framework pair on one device.
FAST = ("jaxpar single", REFERENCE.name)

# Configurations that cannot match the reference, listed rather than silently skipped.
EXCLUDED = {
    "torchref single-ps ps.async=true": "asynchronous SGD: the server applies each worker's gradient as soon as it "
    "arrives (one optimizer step per B/N rows, on weights up to ps.max_staleness versions old), so step k is a "
    "different update, not a reordering of the same sum; its loss is not comparable step by step",
    "torchref *-amp amp.dtype=fp16": "GradScaler skips optimizer steps whose scaled gradients overflow (the first "
    "steps at the default 2^16 scale), so step k of the run is not step k of the reference",
    "jaxpar pipeline.schedule=circular": "needs n_layer >= pipe × repeats with repeats >= 2; gpt2-tiny has 2 layers "
    "(tests/parallel/test_pipeline.py checks circular against gpipe on a deeper model)",
}


# ----------------------------------------------------------------------------- running


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return env


def run_cli(tool: str, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    mod = {"jaxpar": "jaxpar.cli", "torchref": "torchref.cli"}[tool]
    return subprocess.run([sys.executable, "-m", mod, *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(), cwd=Path(__file__).resolve().parents[1])


def prepare_inputs(root: str) -> tuple[str, str]:
    """The shared starting point: (init HF dir, prepared data dir) under `root`."""
    return write_init(os.path.join(root, "init"), TINY, SEED), write_data(os.path.join(root, "data"))


def run_row(row: Row, root: str, init_dir: str, data_dir: str) -> dict:
    """Train one row through its CLI. Returns {losses, grad_norms, wall_s, out}."""
    out = os.path.join(root, "runs", row.name.replace(" ", "_").replace("×", "x").replace("=", "").replace(",", ""))
    args = ["train", *COMMON, *row.args, f"init={init_dir}", f"data={data_dir}", f"out={out}"]
    if row.tool == "jaxpar":
        args += ["train.eval_every=0", "progress=none"]
    else:
        args += ["train.log_every=0", "debug.grad_step=1"]
    t0 = time.perf_counter()
    if not _finished(out, row.tool):  # a kept --workdir reuses finished runs
        shutil.rmtree(out, ignore_errors=True)
        r = run_cli(row.tool, args)
        if r.returncode != 0:
            lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("    @")]
            raise RowFailed(f"`{row.tool} {' '.join(args)}` exited {r.returncode}: " + " | ".join(lines[-3:]))
    recs = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"losses": [r_["loss"] for r_ in recs], "grad_norms": [r_["grad_norm"] for r_ in recs],
            "wall_s": time.perf_counter() - t0, "out": out}


class RowFailed(RuntimeError):
    """A row's run or gradient computation failed (reported as FAIL with this message)."""


def _finished(out: str, tool: str) -> bool:
    m = Path(out, "metrics.jsonl")
    if not m.is_file() or len(m.read_text().splitlines()) != STEPS:
        return False
    return tool == "jaxpar" or Path(out, "grads_step1.safetensors").is_file()


def jax_grads(rows: list[Row], root: str, init_dir: str, data_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """Step-1 gradients of the jaxpar rows (HF names), from one worker process on 8 CPU devices."""
    spec = [{"name": r.name, "mesh": r.mesh, "pipeline": r.pipeline, "precision": r.precision} for r in rows]
    path = os.path.join(root, "jax_grads")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "rows.json"), "w") as f:
        json.dump({"rows": spec, "init": init_dir, "data": data_dir, "common": COMMON}, f)
    env = clean_env()
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out: dict[str, dict | str] = {}
    todo = list(range(len(rows)))
    while todo:  # a row that crashes the worker (XLA abort) is recorded, the worker restarted after it
        with open(os.path.join(path, "todo.json"), "w") as f:
            json.dump(todo, f)
        r = subprocess.run([sys.executable, "-m", "parity_tests.jax_grads", path], capture_output=True, text=True,
                           timeout=1800, env=env, cwd=Path(__file__).resolve().parents[1], check=False)
        done = [i for i in todo if os.path.isfile(os.path.join(path, f"row{i}.npz"))]
        for i in done:
            with np.load(os.path.join(path, f"row{i}.npz")) as z:
                out[rows[i].name] = {k: z[k] for k in z.files}
        rest = [i for i in todo if i not in done]
        if r.returncode != 0 and rest:
            lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("    @")]
            out[rows[rest[0]].name] = f"step-1 gradient worker exited {r.returncode}: " + " | ".join(lines[-3:])
            rest = rest[1:]
        elif rest:
            raise RuntimeError(f"parity_tests.jax_grads wrote no gradients for {[rows[i].name for i in rest]}")
        todo = rest
    return out


def torch_grads(out: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(out, "grads_step1.safetensors"))


def compare(row: Row, res: dict, ref: dict, grads: dict, ref_grads: dict) -> dict:
    """Diffs of one row against the reference and the verdict under TRAJECTORY[row.precision]."""
    tol = TRAJECTORY[row.precision]
    la, lb = np.array(res["losses"]), np.array(ref["losses"])
    assert len(la) == len(lb) == STEPS, (row.name, len(la), len(lb))
    loss_rel = float(np.max(np.abs(la - lb) / np.abs(lb)))
    gna, gnb = np.array(res["grad_norms"]), np.array(ref["grad_norms"])
    gn_rel = float(np.max(np.abs(gna - gnb) / np.abs(gnb)))
    assert set(grads) == set(ref_grads), (row.name, sorted(set(grads) ^ set(ref_grads)))
    g_inf = {k: rel_inf(grads[k], ref_grads[k]) for k in ref_grads}
    g_l2 = {k: rel_l2(grads[k], ref_grads[k]) for k in ref_grads}
    if row.precision == "fp32":
        gkey, gval, gbound = "grad_rel", worst(g_inf), tol["grad_rel"]
    else:
        gkey, gval, gbound = "grad_l2_rel", worst(g_l2), tol["grad_l2_rel"]
    checks = {"loss": loss_rel <= tol["loss_rel"], "grad": gval[1] <= gbound, "grad_norm": gn_rel <= gbound}
    return {"row": row.name, "tool": row.tool, "precision": row.precision, "args": list(row.args),
            "steps": len(la), "max_loss_rel": loss_rel, "loss_bound": tol["loss_rel"],
            "max_loss_abs": float(np.max(np.abs(la - lb))), "grad_metric": gkey, "max_grad": gval[1],
            "worst_grad_param": gval[0], "grad_bound": gbound, "max_grad_norm_rel": gn_rel,
            "grad_params": len(g_inf), "losses": list(map(float, la)), "first_loss": float(la[0]),
            "last_loss": float(la[-1]), "wall_s": res.get("wall_s"), "checks": checks, "pass": all(checks.values())}


def run_matrix(root: str, names: list[str] | None = None, log=print) -> dict:
    """Run `names` (default: every row; the reference always) and compare. Returns the report dict."""
    os.makedirs(root, exist_ok=True)
    init_dir, data_dir = prepare_inputs(root)
    rows = [r for r in ROWS if names is None or r.name in names or r is REFERENCE]
    unknown = set(names or ()) - {r.name for r in ROWS}
    if unknown:
        raise ValueError(f"unknown rows {sorted(unknown)} (choose from {[r.name for r in ROWS]})")
    results: dict[str, dict | str] = {}
    for r in rows:
        log(f"[parity] running {r.name} ...")
        try:
            results[r.name] = res = run_row(r, root, init_dir, data_dir)
            log(f"[parity]   losses {[f'{x:.6f}' for x in res['losses'][:3]]} ... ({res['wall_s']:.0f} s)")
        except RowFailed as e:
            results[r.name] = str(e)
            log(f"[parity]   FAILED: {e}")
    jrows = [r for r in rows if r.tool == "jaxpar" and isinstance(results[r.name], dict)]
    log(f"[parity] step-1 gradients of {len(jrows)} jaxpar rows (8 emulated devices) ...")
    grads = jax_grads(jrows, root, init_dir, data_dir) if jrows else {}
    for r in rows:
        if r.tool == "torchref" and isinstance(results[r.name], dict):
            grads[r.name] = torch_grads(results[r.name]["out"])
    ref, ref_g = results[REFERENCE.name], grads[REFERENCE.name]
    table = []
    for r in rows:
        err = results[r.name] if isinstance(results[r.name], str) else grads.get(r.name)
        if isinstance(err, str):
            table.append({"row": r.name, "tool": r.tool, "precision": r.precision, "args": list(r.args),
                          "error": err, "pass": False, "checks": {"ran": False}})
        else:
            table.append(compare(r, results[r.name], ref, grads[r.name], ref_g))
    return {"reference": REFERENCE.name, "steps": STEPS, "common": COMMON, "model": asdict(TINY),
            "init": init_dir, "data": data_dir, "tolerances": TRAJECTORY, "rows": table,
            "excluded": [{"row": k, "reason": v} for k, v in EXCLUDED.items()]}
