"""Checkpoints with orbax: `<run>/ckpt/<step>/{params,opt_state,meta}`.

Orbax writes each step into a temporary dir and renames it when complete, so
`latest_step()` never returns a half-written checkpoint. Saves are synchronous:
the step's donated buffers are reused right after, and CPU runs gain nothing from async.
The data position and dropout RNG are pure functions of (seed, step), so `step` in
`meta` is all a resumed run needs besides params and optimizer state.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from jaxpar.config import ConfigError

CKPT_DIR = "ckpt"


class Checkpointer:
    def __init__(self, run_dir: str, max_to_keep: int = 2, create: bool = True):
        self.dir = os.path.abspath(os.path.join(run_dir, CKPT_DIR))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                            enable_async_checkpointing=False)
        self.mngr = ocp.CheckpointManager(self.dir, options=opts,
                                          item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        items = {"params": ocp.args.StandardSave(state["params"]), "meta": ocp.args.JsonSave(meta)}
        if state.get("opt_state") is not None:
            items["opt_state"] = ocp.args.StandardSave(state["opt_state"])
        self.mngr.save(step, args=ocp.args.Composite(**items), force=True)
        self.mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """Full state (params, opt_state) placed with the shardings in `abstract_state`."""
        r = self.mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state["params"]),
            opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]),
            meta=ocp.args.JsonRestore()))
        return {"params": r["params"], "opt_state": r["opt_state"]}, dict(r["meta"])

    def restore_params(self, step: int, abstract_params) -> tuple[dict, dict]:
        r = self.mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()))
        return r["params"], dict(r["meta"])

    def close(self) -> None:
        self.mngr.close()


def open_existing(run_dir: str) -> tuple[Checkpointer, int]:
    """Checkpointer over an existing run dir and its latest complete step, or ConfigError."""
    if not os.path.isdir(os.path.join(run_dir, CKPT_DIR)):
        raise ConfigError(f"checkpoint={run_dir!r} has no {CKPT_DIR}/ directory (not a jaxpar run dir)")
    ck = Checkpointer(run_dir, create=False)
    step = ck.latest_step()
    if step is None:
        raise ConfigError(f"checkpoint={run_dir!r} holds no complete checkpoint")
    return ck, step
