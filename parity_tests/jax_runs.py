"""Worker: short `jaxpar train` runs on 8 emulated CPU devices, one JSON request per stdin line.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m parity_tests.jax_runs

Request: {"args": ["key=value", ...]} — the keys `jaxpar train` would get. Reply (one stdout
line): {"losses": [...], "grad_norms": [...], "compile_s", "run_s"} or {"error": "..."}.

A run here is `jaxpar.run.loop.run_train` without its files: the same `resolve` + `validate` +
`check_model_vs_mesh`, the numpy init `gpt2.init_params(model, seed)` (or `load_hf(init)`), the
same `build_trainer` step function and the same `train_batch(seed, step)` batches. The one
difference: the mesh takes the first `mesh size` of the 8 devices (the CLI would emulate exactly
that many), so one warm process serves every mesh a property test draws.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback


def run(args: list[str]) -> dict:
    import jax

    from gpt2common import data, hf
    from jaxpar.config import ConfigError, resolve, validate
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import build_mesh, mesh_size, resolve_mesh_config
    from jaxpar.train import build_trainer, check_model_vs_mesh

    try:
        cfg = resolve(args)
        params = None
        if cfg.init:
            model, params = hf.load_hf(cfg.init)
            cfg = dataclasses.replace(cfg, model=model)
        n = mesh_size(cfg.mesh)
        cfg = validate(dataclasses.replace(cfg, mesh=resolve_mesh_config(cfg.mesh, n)))
        check_model_vs_mesh(cfg.model, cfg)
    except ConfigError as e:
        return {"error": f"ConfigError: {e}"}
    mesh = build_mesh(cfg.mesh, jax.devices()[:n])
    tc = cfg.train
    trainer = build_trainer(build_layout(cfg, mesh.devices.size), mesh)
    state = trainer.init_state(params if params is not None else gpt2.init_params(cfg.model, cfg.seed))
    ds = data.Dataset.open(cfg.data, cfg.model.vocab_size, tc.seq_len)
    t0 = time.perf_counter()
    x, y = data.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, 0)
    step_fn = trainer.step_fn.lower(state, trainer.put_batch(x), trainer.put_batch(y)).compile()
    t1 = time.perf_counter()
    losses, norms = [], []
    for step in range(tc.steps):
        x, y = data.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, step)
        state, m = step_fn(state, trainer.put_batch(x), trainer.put_batch(y))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return {"losses": losses, "grad_norms": norms, "compile_s": t1 - t0, "run_s": time.perf_counter() - t1}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = run(json.loads(line)["args"])
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
