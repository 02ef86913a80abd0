"""The parity matrix at a glance: `python -m parity_tests.report [--out DIR] [--fast] [--rows A,B]`.

Runs the single-device model parity (gpt2-tiny and a non-preset shape) and the training matrix
(every jaxpar configuration and torchref strategy, `parity_tests.matrix.ROWS`), prints a markdown
table and writes DIR/parity.md and DIR/parity.json (default DIR: parity_report/). Exit code 0 when
every row is within `parity_tests/tolerances.py`, 1 otherwise. `--fast`: only the default-test
subset (jaxpar single vs torchref single). The full matrix takes ~10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

MODEL_SHAPES = (("gpt2-tiny", "TINY"), ("odd: L=3 D=60 H=5 V=101", "ODD"))


def model_row(name: str, r) -> dict:
    """One report row from a `common.ModelParity`, judged by tolerances.MODEL."""
    from parity_tests.common import worst
    from parity_tests.tolerances import MODEL

    g = worst(r.grad_rel)
    u = {k: worst(v) for k, v in r.update_rel.items()}
    checks = {"logits": r.logits_abs <= MODEL["logits_abs"], "loss": r.loss_rel <= MODEL["loss_rel"],
              "grad": g[1] <= MODEL["grad_rel"], "adamw": all(v[1] <= MODEL["update_rel"] for v in u.values())}
    return {"model": name, "shape": r.model, "logits_abs": r.logits_abs, "loss_rel": r.loss_rel,
            "max_grad_rel": g[1], "worst_grad_param": g[0], "grad_params": r.n_params,
            "grad_norm_step1": r.grad_norm, "adamw_update_rel": {str(k): v[1] for k, v in u.items()},
            "adamw_worst_param": {str(k): v[0] for k, v in u.items()}, "checks": checks, "pass": all(checks.values())}


def model_rows(root: str) -> list[dict]:
    from parity_tests import common

    out = []
    for name, attr in MODEL_SHAPES:
        cfg = getattr(common, attr)
        d = os.path.join(root, "model_" + name.split(":")[0])
        init_dir = common.write_init(os.path.join(d, "init"), cfg)
        out.append(model_row(name, common.model_parity(init_dir, common.write_data(os.path.join(d, "data"),
                                                                                   cfg.vocab_size))))
    return out


def _e(x: float) -> str:
    return f"{x:.1e}"


def markdown(rep: dict) -> str:
    from parity_tests.common import OPTIMIZER_MAP
    from parity_tests.tolerances import MODEL, TRAJECTORY

    L = ["# jaxpar vs torchref parity", ""]
    if rep.get("model_parity"):
        L += ["## Model parity (fp32, one device, shared numpy init through the HF converters)", "",
              f"Bounds: logits abs {_e(MODEL['logits_abs'])}, loss rel {_e(MODEL['loss_rel'])}, grads rel "
              f"{_e(MODEL['grad_rel'])}, AdamW update rel {_e(MODEL['update_rel'])} (same grads fed to both optimizers).",
              "", "| model | logits max abs | loss rel | max grad rel (worst of N params) | AdamW k=1 | AdamW k=3 | pass |",
              "|---|---|---|---|---|---|---|"]
        for m in rep["model_parity"]:
            L.append(f"| {m['model']} | {_e(m['logits_abs'])} | {_e(m['loss_rel'])} | {_e(m['max_grad_rel'])} "
                     f"({m['grad_params']}) | {_e(m['adamw_update_rel']['1'])} | {_e(m['adamw_update_rel']['3'])} "
                     f"| {'PASS' if m['pass'] else 'FAIL'} |")
        L += ["", "Optimizer mapping (optax <-> torch.optim):", ""] + [f"- **{k}**: {v}" for k, v in OPTIMIZER_MAP.items()]
        L.append("")
    if rep.get("training"):
        t = rep["training"]
        L += [f"## Training parity ({t['steps']} steps, gpt2-tiny, T=32, B=8, reference: {t['reference']})", "",
              "Loss: max over steps of |loss - ref| / ref. Grad: step-1 gradient, worst parameter tensor "
              "(fp32: max|a-b|/max|b|; bf16: ||a-b||/||b||). Grad norm: logged pre-clip norm, every step.", "",
              "| row | precision | max loss diff (rel) | bound | max grad diff | bound | max grad-norm diff | pass |",
              "|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            if "error" in r:
                L.append(f"| {r['row']} | {r['precision']} | — | {_e(TRAJECTORY[r['precision']]['loss_rel'])} | — | "
                         f"— | — | FAIL: {r['error'][:300]} |")
                continue
            L.append(f"| {r['row']} | {r['precision']} | {_e(r['max_loss_rel'])} | {_e(r['loss_bound'])} | "
                     f"{_e(r['max_grad'])} | {_e(r['grad_bound'])} | {_e(r['max_grad_norm_rel'])} | "
                     f"{'PASS' if r['pass'] else 'FAIL'} |")
        L += ["", "### Excluded", ""] + [f"- **{e['row']}**: {e['reason']}" for e in t["excluded"]]
    L += ["", f"Overall: {'PASS' if rep['pass'] else 'FAIL'}", ""]
    return "\n".join(L)


def build(root: str, fast: bool = False, rows: list[str] | None = None, model: bool = True, log=print) -> dict:
    from parity_tests import matrix

    t0 = time.perf_counter()
    rep: dict = {}
    if model:
        log("[parity] model parity (gpt2-tiny, odd shape) ...")
        rep["model_parity"] = model_rows(root)
    names = list(matrix.FAST) if fast else rows
    rep["training"] = matrix.run_matrix(root, names, log=log)
    oks = [m["pass"] for m in rep.get("model_parity", [])] + [r["pass"] for r in rep["training"]["rows"]]
    rep["pass"] = all(oks)
    rep["wall_s"] = time.perf_counter() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.report", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="parity_report", help="where parity.md and parity.json go")
    ap.add_argument("--fast", action="store_true", help="only jaxpar single vs torchref single")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--no-model", action="store_true", help="skip the single-device model parity")
    ap.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    a = ap.parse_args(argv)
    root = a.workdir or tempfile.mkdtemp(prefix="parity_")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()] or None
    rep = build(root, a.fast, rows, not a.no_model, log=lambda m: print(m, file=sys.stderr, flush=True))
    md = markdown(rep)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "parity.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "parity.json"), "w") as f:
        json.dump(rep, f, indent=2)
    print(md)
    print(f"wrote {os.path.join(a.out, 'parity.md')} and parity.json ({rep['wall_s']:.0f} s)")
    return 0 if rep["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
