"""Training-state handoff between the frameworks: N steps in one, M more in the other, compared
step by step with runs that stay in one framework (the format: docs/state_format.md).

Both directions through the CLIs (jaxpar's in subprocesses, torchref's launcher in this process), from the shared init and data of the parity matrix
(`matrix.prepare_inputs`, gpt2-tiny, B=8, T=32, fp32), one schedule of N+M steps:

  jaxpar -> torchref   `jaxpar train` N+M steps with a checkpoint at N (on `mesh`: the run that
                       stays in jaxpar); `jaxpar convert checkpoint= step=N to_state=`;
                       `torchref train init_state=` runs steps N+1..N+M.
  torchref -> jaxpar   `torchref train state_every=N` N+M steps (the run that stays in torchref,
                       writing <out>/state/N/); `jaxpar train init_state=<out>/state/N` on `mesh`.

The continued steps' (loss, grad_norm) are held to `TRAJECTORY["fp32"]` against both the run that
stayed in the sending framework and the one that stayed in the receiving one (torchref single,
or jaxpar on the same mesh). `python -m parity_tests.handoff` prints the report of one mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from parity_tests.common import trajectory_diffs
from parity_tests.matrix import COMMON, clean_env, prepare_inputs
from parity_tests.tolerances import TRAJECTORY

ROOT = Path(__file__).resolve().parents[1]


def _common(n: int, m: int) -> list[str]:
    """The matrix's shared keys with a schedule of n + m steps; the model is named (init= gives the
    matrix runs their shape, a state must meet the shape it was written with)."""
    return ["model=gpt2-tiny"] + [a for a in COMMON if not a.startswith("train.steps=")] + [f"train.steps={n + m}"]


def cli(tool: str, args: list[str], root: str, timeout: float = 900) -> None:
    """`jaxpar args` in a subprocess: every jaxpar run under `root` shares one XLA compilation cache
    (the run that stays in jaxpar and the one that continues a state compile the same step).
    `torchref train args` in this process, as parity_tests/property.py runs it: its launcher forks the
    ranks from one warm zygote (torch imported once for every torchref run of the process)."""
    if tool == "torchref":
        import contextlib
        import io

        from gpt2common.grammar import ConfigError
        from torchref import launch
        from torchref.config import WorkerDied, resolve_ref

        assert args[0] == "train", args
        try:
            cfg, ref = resolve_ref(args[1:])
            with contextlib.redirect_stdout(io.StringIO()):
                launch.train(cfg, ref)
        except (ConfigError, WorkerDied) as e:
            raise RuntimeError(f"`torchref {' '.join(args)}`: {e}") from None
        return
    env = clean_env()
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(root, "xla-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"`jaxpar {' '.join(args)}` exited {r.returncode}: {r.stderr[-2000:]}")


def steps(out: str) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} of a run's metrics.jsonl."""
    recs = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}


def jaxpar_args(mesh: dict, pipeline: dict) -> list[str]:
    return ([f"mesh.{k}={v}" for k, v in mesh.items()] + [f"pipeline.{k}={v}" for k, v in pipeline.items()]
            + ["precision=fp32", "train.eval_every=0", "progress=none"])


def compare(run: dict, ref: dict, first: int, last: int) -> dict:
    """Steps first..last of `run` against `ref` under the fp32 trajectory bounds."""
    want = list(range(first, last + 1))
    assert sorted(run) == want, (sorted(run), want)
    d = trajectory_diffs([run[s] for s in want], [ref[s] for s in want], TRAJECTORY["fp32"])
    return {k: d[k] for k in ("max_loss_rel", "max_grad_norm_rel", "grad_bound", "pass")}


def handoff(root: str, n: int, m: int, mesh: dict | None = None, pipeline: dict | None = None) -> dict:
    """Both directions with jaxpar on `mesh` (default one device). Returns per direction the
    continued steps and their diffs against each run that stayed in one framework."""
    mesh, pipeline = mesh or {}, pipeline or {}
    init_dir, data_dir = prepare_inputs(root)
    common = _common(n, m) + [f"data={data_dir}"]
    tag = "_".join(f"{k}{v}" for k, v in {**mesh, **pipeline}.items()) or "single"
    run = lambda name: os.path.join(root, "runs", f"{tag}-{name}")  # noqa: E731
    jx = jaxpar_args(mesh, pipeline)
    tr = ["train.log_every=0"]

    # The runs that stay in one framework; each also writes the state at step n.
    cli("jaxpar", ["train", *common, *jx, f"init={init_dir}", f"train.ckpt_every={n}", f"out={run('jaxpar')}"], root)
    ref_torch = os.path.join(root, "runs", "torchref")  # mesh-independent: shared by every mesh's handoff
    if not os.path.isfile(os.path.join(ref_torch, "summary.json")):
        cli("torchref", ["train", *common, *tr, f"init={init_dir}", f"state_every={n}", f"out={ref_torch}"], root)
    # jaxpar -> torchref
    state = run(f"state{n}")
    cli("jaxpar", ["convert", f"checkpoint={run('jaxpar')}", f"step={n}", f"to_state={state}"], root)
    cli("torchref", ["train", *common, *tr, f"init_state={state}", f"out={run('to-torchref')}"], root)
    # torchref -> jaxpar
    cli("jaxpar", ["train", *common, *jx, f"init_state={os.path.join(ref_torch, 'state', str(n))}",
                   f"out={run('to-jaxpar')}"], root)

    stay_j, stay_t = steps(run("jaxpar")), steps(ref_torch)
    to_t, to_j = steps(run("to-torchref")), steps(run("to-jaxpar"))
    last = n + m
    return {"mesh": tag, "n": n, "m": m,
            "jaxpar->torchref": {"steps": sorted(to_t), "vs_jaxpar": compare(to_t, stay_j, n + 1, last),
                                 "vs_torchref": compare(to_t, stay_t, n + 1, last)},
            "torchref->jaxpar": {"steps": sorted(to_j), "vs_torchref": compare(to_j, stay_t, n + 1, last),
                                 "vs_jaxpar": compare(to_j, stay_j, n + 1, last)},
            "trained": stay_t[1][0] - stay_t[last][0]}


if __name__ == "__main__":
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("keys", nargs="*", help="mesh.*= / pipeline.*= keys of the jaxpar side")
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--m", type=int, default=5)
    a = p.parse_args()
    kv = dict(k.split("=", 1) for k in a.keys)
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(handoff(d, a.n, a.m, {k[5:]: v for k, v in kv.items() if k.startswith("mesh.")},
                                 {k[9:]: v for k, v in kv.items() if k.startswith("pipeline.")}), indent=1))
