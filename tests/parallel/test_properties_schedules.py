"""Every table schedule (jaxpar/parallel/pipeline_exec.py: 1f1b, zb, interleaved) against autodiff of
the GPipe forward (circular with R chunks), loss and every gradient, for drawn stages S, microbatches
M, chunks R, layers L, data / fsdp replicas, dropout (the same key: the schedules must draw GPipe's
masks in every forward and re-run) and pipeline.gather (step / layer).

The draws run inside one subprocess on 8 emulated CPU devices, with hypothesis' fixed-seed settings;
a failing case's assertion names the command that reruns it alone. Bound: jaxpar.tolerances
SHARDED_VS_SINGLE fp32 (the schedules compute the same products and reorder fp32 sums), as
tests/parallel/test_properties_1f1b.py.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

SLOW = 24
# the default suite's one case: ZB-H1 with dropout, each layer gathered where it runs, fsdp and data
FAST_EXAMPLES = [{"sched": "zb", "S": 2, "M": 3, "R": 1, "L": 3, "data": 2, "fsdp": 2, "dropout": 0.1,
                  "gather": "layer"}]
SLOW_EXAMPLES = [{"sched": "interleaved", "S": 2, "M": 4, "R": 2, "L": 5, "data": 1, "fsdp": 2, "dropout": 0.1,
                  "gather": "step"},
                 {"sched": "1f1b", "S": 4, "M": 2, "R": 1, "L": 4, "data": 2, "fsdp": 1, "dropout": 0.1,
                  "gather": "step"}]
T = 8  # sequence length; one row per microbatch per replica


def reproduce(c: dict) -> str:
    return (f"XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH=. "
            f"python tests/parallel/test_properties_schedules.py case /tmp/case.json '{json.dumps(c)}'")


def _setup():
    import jax

    # XLA's optimization passes change fusion and layout, not which products are summed
    jax.config.update("jax_disable_most_optimizations", True)


def check_case(c: dict) -> dict:
    """Loss and gradients of c's schedule vs GPipe (R = 1) / circular (R > 1) with the same key."""
    import jax

    from jaxpar.config import Config, MeshConfig, ModelConfig, PipelineConfig, TrainConfig
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.tolerances import SHARDED_VS_SINGLE
    from jaxpar.train import build_trainer, make_loss_fn

    tol = SHARDED_VS_SINGLE["fp32"]
    model = ModelConfig(n_layer=c["L"], n_embd=16, n_head=2, vocab_size=64, n_positions=T, dropout=c["dropout"])
    B = c["M"] * c["data"] * c["fsdp"]
    key = jax.random.PRNGKey(7) if c["dropout"] else None
    rng = np.random.default_rng(c["S"] * 100 + c["M"] * 10 + c["L"])
    x, y = (rng.integers(0, model.vocab_size, (B, T), dtype=np.int32) for _ in range(2))

    def value_and_grad(sched, k):
        cfg = Config(model=model, mesh=MeshConfig(pipe=c["S"], data=c["data"], fsdp=c["fsdp"]), precision="fp32",
                     pipeline=PipelineConfig(microbatches=c["M"], schedule=sched, repeats=c["R"], gather=c["gather"]),
                     train=TrainConfig(batch_size=B, seq_len=T, warmup_steps=0))
        mesh = build_mesh(cfg.mesh, jax.devices()[:c["S"] * c["data"] * c["fsdp"]])
        tr = build_trainer(build_layout(cfg, mesh.devices.size), mesh)
        loss_fn = make_loss_fn(tr.layout, mesh)
        psh = tr.state_shardings["params"]
        vg = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, k)),
                     in_shardings=(psh, tr.batch_sharding, tr.batch_sharding), out_shardings=(None, psh))
        loss, g = vg(jax.device_put(gpt2.init_params(model, 0), psh), tr.put_batch(x), tr.put_batch(y))
        return float(loss), {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(g)[0]}

    ref = "gpipe" if c["R"] == 1 else "circular"
    (la, ga), (lb, gb) = value_and_grad(ref, key), value_and_grad(c["sched"], key)
    assert abs(lb - la) <= tol["loss"] * abs(la), (c, la, lb, reproduce(c))
    assert sorted(ga) == sorted(gb) and len(ga) == 16
    worst = 0.0
    for k in ga:  # inf-relative per tensor, as the table entry measures it
        rel = float(np.max(np.abs(gb[k] - ga[k])) / max(float(np.max(np.abs(ga[k]))), 1e-30))
        worst = max(worst, rel)
        assert rel <= tol["grad"], (c, k, rel, reproduce(c))
    return {"case": c, "loss": [la, lb], "worst_grad_rel": worst}


def run_drawn(prop, cases, fast: list[dict], slow: list[dict], n_examples: int) -> None:
    """prop(c) over the `fast` examples, and with n_examples > 0 the `slow` ones and n_examples draws of
    `cases` (hypothesis, fixed seed, no database, no deadline: each example compiles whole steps)."""
    from hypothesis import Phase, example, given, settings

    prop = given(c=cases)(prop)
    for c in fast + (slow if n_examples else []):
        prop = example(c=c)(prop)
    phases = list(Phase) if n_examples else [Phase.explicit]
    settings(max_examples=max(n_examples, 1), phases=phases, deadline=None, derandomize=True, database=None)(prop)()


def _property(n_examples: int, no_dropout_loss: bool) -> dict:
    _setup()
    from hypothesis import strategies as st

    ran = []

    @st.composite
    def cases(draw):
        sched = draw(st.sampled_from(["1f1b", "zb", "interleaved"]))
        S = draw(st.integers(2, 4))
        R = draw(st.integers(1, 2)) if sched == "interleaved" else 1
        M = S * draw(st.integers(1, 2)) if sched == "interleaved" else draw(st.integers(1, 2 * S + 1))
        fsdp = draw(st.sampled_from([1, 2] if 2 * S <= 8 else [1]))
        data = draw(st.sampled_from([1, 2] if 2 * S * fsdp <= 8 else [1]))
        return {"sched": sched, "S": S, "M": M, "R": R, "L": draw(st.integers(R * S, R * S + 2)), "data": data,
                "fsdp": fsdp, "dropout": draw(st.sampled_from([0.0, 0.1])),
                "gather": draw(st.sampled_from(["step", "layer"]))}

    run_drawn(lambda c: ran.append(check_case(c)), cases(), FAST_EXAMPLES, SLOW_EXAMPLES, n_examples)
    out = {"cases": ran}
    if no_dropout_loss:  # the explicit case without dropout: the masks change the loss
        out["no_dropout"] = check_case({**FAST_EXAMPLES[0], "dropout": 0.0})["loss"]
    return out


def _run(tmp_path, *args):
    from support.cli_helpers import run_worker

    return run_worker(__file__, tmp_path, *args)


def test_table_schedules_equal_autodiff_of_gpipe(tmp_path):
    r = _run(tmp_path, "prop", "0")
    assert [x["case"] for x in r["cases"]] == FAST_EXAMPLES
    # dropout is drawn (not dropped by both): the same case without it scores another loss
    assert abs(r["cases"][0]["loss"][0] - r["no_dropout"][0]) > 1e-3, r


@pytest.mark.slow
def test_table_schedules_equal_autodiff_of_gpipe_slow(tmp_path):
    r = _run(tmp_path, "prop", str(SLOW))
    cases = [x["case"] for x in r["cases"]]
    assert len(cases) >= SLOW // 2  # hypothesis may stop early once the space is exhausted
    assert {c["sched"] for c in cases} == {"1f1b", "zb", "interleaved"}
    assert {(c["dropout"] > 0, c["gather"]) for c in cases} >= {(True, "layer"), (False, "step")}


if __name__ == "__main__":
    kind, out_path, *args = sys.argv[1:]
    if kind == "case":  # one case, as a failing assertion's reproduction command gives it
        _setup()
        res = check_case(json.loads(args[0]))
    else:
        res = _property(int(args[0]), no_dropout_loss=args[0] == "0")
    with open(out_path, "w") as f:
        json.dump(res, f)
    print(json.dumps(res))
