"""The parity matrix at a glance: `python -m parity_tests.report [--out DIR] [--fast] [--rows A,B]`.

Runs the single-device model parity (gpt2-tiny and a non-preset shape), the training matrix
(every jaxpar configuration and torchref strategy, `parity_tests.matrix.ROWS`) and the
property-based set (`parity_tests.property`, >= 40 drawn configurations), prints a markdown
table and writes DIR/parity.md and DIR/parity.json (default DIR: parity_tests/results/, the
committed copy) with the date, the commit and the host's CPU flags. Exit code 0 when every row
is within `parity_tests/tolerances.py`, 1 otherwise. `--fast`: only jaxpar single vs torchref
single, no property set. The whole report takes ~30-60 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

MODEL_SHAPES = (("gpt2-tiny", "TINY"), ("odd: L=3 D=60 H=5 V=101", "ODD"))
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")


def host() -> dict:
    """Date, commit and the CPU facts that decide bf16 speed and rounding paths."""
    import datetime
    import platform
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout.strip()  # noqa: E731
    from jaxpar.tolerances import cpu_flags, cpu_model

    flags, model = cpu_flags(), cpu_model() or platform.processor()  # cpu_flags: the host kind the bounds were picked for
    return {"date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "cpu": model, "cores": os.cpu_count(), "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "native_bf16": any(f in flags for f in NATIVE_BF16)}


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
    h = rep.get("host")
    if h:
        present = [f for f, on in h["cpu_flags"].items() if on]
        L += [f"Measured {h['date_utc']} UTC at commit `{h['commit'][:12]}`{' (+ local changes)' if h['dirty'] else ''} "
              f"on {h['cpu']} ({h['cores']} cores; flags: {', '.join(present) or 'none of ' + ', '.join(CPU_FLAGS)}).", ""]
        if h["native_bf16"]:
            L += ["bf16: this CPU has native bf16 (" + ", ".join(f for f in NATIVE_BF16 if h["cpu_flags"][f]) + "); "
                  "the bf16 rows below (jaxpar precision=bf16, torchref -amp = autocast(bf16)) ran on it.", ""]
        else:
            L += ["bf16: this CPU has NO native bf16 (neither avx512_bf16 nor amx_bf16): the bf16 rows below ran "
                  "through software bf16 (XLA and torch emulate the conversions); their bounds are the same, "
                  "their speed is not representative.", ""]
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
    if rep.get("property"):
        p = rep["property"]
        n_pass = sum(e["pass"] for e in p["examples"])
        L += ["", f"## Property-based set ({len(p['examples'])} drawn configurations, {n_pass} pass)", "",
              "Each example draws a model shape, every optimizer and schedule key, grad_accum, memory knobs, seed, "
              "a jaxpar mesh on 8 emulated devices and a synchronous fp32 torchref strategy "
              "(`parity_tests/property.py`); both sides start from the shared numpy init. Per step: loss and "
              f"logged pre-clip grad norm, bounds {_e(p['bounds']['loss_rel'])} / {_e(p['bounds']['grad_rel'])} "
              "(tolerances.TRAJECTORY['fp32']). Configuration: layers/heads/embd/vocab/positions | batch, seq, "
              "steps, warmup, lr, min_lr_ratio, wd, betas, eps, clip, accum, seed | jaxpar mesh and knobs | "
              "torchref strategy×workers.", "",
              "| # | configuration | steps | max loss diff (rel) | max grad-norm diff (rel) | pass |", "|---|---|---|---|---|---|"]
        for i, e in enumerate(p["examples"], 1):
            if "error" in e:
                L.append(f"| {i} | {e['config']} | — | — | — | FAIL: {e['error'][:200]} |")
            else:
                L.append(f"| {i} | {e['config']} | {e['steps']} | {_e(e['max_loss_rel'])} | "
                         f"{_e(e['max_grad_norm_rel'])} | {'PASS' if e['pass'] else 'FAIL'} |")
        fails = [e for e in p["examples"] if not e["pass"]]
        for e in fails[:3]:
            L += ["", "Reproduce a failing example:", "", "```", e["commands"], "```"]
        L += ["", "Left out of the draw:", ""] + [f"- **{k}**: {v}" for k, v in p["excluded"].items()]
    L += ["", f"Overall: {'PASS' if rep['pass'] else 'FAIL'}", ""]
    return "\n".join(L)


def _start_property_set(root: str, n: int, log):
    """The property set in a thread (its work happens in subprocesses: the jaxpar worker and the
    torchref ranks), so it overlaps the matrix. Returns a function that joins it."""
    import threading

    from parity_tests import property as P

    out: dict = {}

    def work():
        try:
            out["examples"] = P.run_set(os.path.join(root, "property"), n, log=log)
        except BaseException as e:  # noqa: BLE001 - reported as a failing row
            out["examples"] = [{"config": "(property set)", "pass": False, "error": f"{type(e).__name__}: {e}",
                                "commands": ""}]
        finally:
            P.JaxRuns.close()

    log(f"[parity] property-based set ({n} examples) in the background ...")
    th = threading.Thread(target=work, daemon=True)
    th.start()

    def join() -> dict:
        th.join()
        return {"examples": out["examples"], "bounds": P.BOUNDS, "excluded": P.EXCLUDED}

    return join


def build(root: str, fast: bool = False, rows: list[str] | None = None, model: bool = True, log=print,
          examples: int = 0) -> dict:
    from parity_tests import matrix

    t0 = time.perf_counter()
    rep: dict = {"host": host()}
    prop = _start_property_set(root, examples, log) if examples else None  # runs beside the matrix
    if model:
        log("[parity] model parity (gpt2-tiny, odd shape) ...")
        rep["model_parity"] = model_rows(root)
    names = list(matrix.FAST) if fast else rows
    rep["training"] = matrix.run_matrix(root, names, log=log)
    if prop:
        rep["property"] = prop()
    oks = [m["pass"] for m in rep.get("model_parity", [])] + [r["pass"] for r in rep["training"]["rows"]]
    oks += [e["pass"] for e in rep.get("property", {}).get("examples", [])]
    rep["pass"] = all(oks)
    rep["wall_s"] = time.perf_counter() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.report", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="where parity.md and parity.json go (default: parity_tests/results)")
    ap.add_argument("--fast", action="store_true", help="only jaxpar single vs torchref single, no property set")
    ap.add_argument("--examples", type=int, default=40, help="property-based examples (default 40)")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--no-model", action="store_true", help="skip the single-device model parity")
    ap.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    a = ap.parse_args(argv)
    root = a.workdir or tempfile.mkdtemp(prefix="parity_")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()] or None
    rep = build(root, a.fast, rows, not a.no_model, log=lambda m: print(m, file=sys.stderr, flush=True),
                examples=0 if a.fast else a.examples)
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
