"""jaxpar train step vs HF transformers GPT2LMHeadModel (eager and torch.compile), one device.

Same GPT-2 config, same batch (B, T), same weights, same optimizer on both sides, fp32 and
bf16 (jaxpar `precision=bf16` policy; torch.autocast(bfloat16) for torch). One timed step is a
full train step: forward + backward + global-norm clip + AdamW update, synchronised at the end
(`block_until_ready` / the loss `.item()`).

Fairness rules:
  * torch uses as many intra-op threads as JAX's CPU client (all cores by default, `--threads`);
  * warm-up steps (compilation included) are excluded;
  * the contenders are interleaved in turns: each turn runs `--settle` untimed steps of one
    contender, then times `--block` consecutive steps of it, and the turns rotate over the
    contenders until each has `--rounds` timed steps. Machine noise (other jobs on a shared box)
    hits all of them alike; we report the median and the spread (p10/p90) per contender.
    The settle step is there because a contender's first step after another one's is not a
    training step: torch's OpenMP workers spin-wait after each parallel region (libgomp's
    default), so they hold a core through the start of whatever runs next. On the 2-core Zen 4
    host, small fp32, one timed step per turn: jaxpar 0.038-0.053 s/step after a torch step vs
    0.035-0.036 alone; with OMP_WAIT_POLICY=PASSIVE (torch's threads sleep) 0.036-0.037 but torch
    1.6x slower; with a settle step 0.036-0.037, torch unchanged (0.041-0.043 either way).
    Each turn's settle-step times are reported (`settle_s`) so the switch cost stays visible;
  * the ratio is `torch_time / jaxpar_time` (> 1: jaxpar is faster);
  * host memory (`--host-memory`, default both): `jaxpar train` makes glibc keep freed memory
    mapped before JAX starts (jaxpar/run/host_memory.py), a process-wide malloc setting that the
    contenders of one process share. On the 2-core native-bf16 host it makes torch bf16 about 2x
    slower (small: 0.051 -> 0.092 s/step eager) and torch eager fp32 faster (0.054 -> 0.044). So
    `both` runs the whole interleaved benchmark twice, in a process with the setting and one
    without, and takes jaxpar's figures from the first (what `jaxpar train` runs) and each torch
    contender's from whichever process was faster for it (torch never calls mallopt itself).

Configurations (`--configs`, comma list; each runs its own interleaved rounds):
  small  nanoGPT's CPU config: 4 layers, 4 heads, n_embd 128, vocab 256, seq 64, batch 12
  mid    6 layers, 6 heads, n_embd 384, vocab 256, seq 256, batch 8
  gpt2   GPT-2 124M (12 layers, 12 heads, n_embd 768, vocab 50257), seq 256, batch 2
  custom the --n-layer/--n-embd/--n-head/--vocab/--seq/--batch flags (a micro run for tests:)

    python benchmarks/single_device.py --configs custom --n-layer 1 --n-embd 64 --n-head 2 --vocab 256 \
        --seq 32 --batch 2 --rounds 3 --out /tmp/sd.json

torch bf16 (autocast) runs only where torch has a native bf16 gemm (oneDNN avx512_bf16/AMX);
the report says which (`env.torch_native_bf16`, `skipped`). The host's CPU flags and load
average (before and after) are recorded, since on a shared machine every figure moves with load.

Writes JSON (default benchmarks/results/single_device.json) and prints a ratio table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

IMPLS = ("jaxpar", "torch_eager", "torch_compile")


# name -> (n_layer, n_embd, n_head, vocab, seq, batch); see the module docstring
CONFIGS = {
    "small": (4, 128, 4, 256, 64, 12),
    "mid": (6, 384, 6, 256, 256, 8),
    "gpt2": (12, 768, 12, 50257, 256, 2),
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


def config_of(dims, precision: str, seed: int = 0):
    """The jaxpar Config of a CONFIGS entry (n_layer, n_embd, n_head, vocab, seq, batch). Constant lr (no
    warmup): every step does the same AdamW arithmetic, as torch's side here does."""
    from jaxpar.config import Config, ModelConfig, TrainConfig

    n_layer, n_embd, n_head, vocab, seq, batch = dims
    mc = ModelConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=max(seq, 1024))
    tc = TrainConfig(batch_size=batch, seq_len=seq, warmup_steps=0, steps=10**6, min_lr_ratio=1.0)
    return Config(model=mc, train=tc, precision=precision, seed=seed)


def cpu_flags() -> list[str]:
    """The CPU features that decide bf16 speed (benchmarks/README.md, single_device.py)."""
    from jaxpar.tolerances import cpu_flags as all_flags

    have = all_flags()
    return [c for c in CPU_FLAGS if c in have]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="small,mid,gpt2", help="comma list of " + ",".join([*CONFIGS, "custom"]))
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32,bf16")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender (after compile)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per contender (interleaved in turns)")
    p.add_argument("--block", type=int, default=3, help="timed consecutive steps per contender turn")
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps at the start of each turn (the previous contender's threads wind down)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: os.cpu_count() (JAX's)")
    p.add_argument("--torch-bf16", choices=("auto", "full", "skip"), default="auto",
                   help="auto: run torch bf16 only where the CPU has native bf16 matmul (oneDNN avx512_bf16/AMX); "
                        "without it torch's bf16 gemm is a scalar fallback (~1 GFLOP/s, minutes per step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-memory", choices=("both", "keep", "default"), default="both",
                   help="keep: glibc keeps freed memory (as `jaxpar train`); default: glibc's own; both: one process "
                        "each, jaxpar from keep, each torch contender from its faster process")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "single_device.json"))
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- contenders
# Each contender is a callable `step()` that runs one full train step and blocks until done.


def make_jaxpar(cfg, params, inputs, targets):
    """The real jaxpar step (`build_trainer`: jit, donated state) on a 1-device mesh."""
    import jax

    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer

    trainer = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])  # one device, even if emulating more
    state = {"s": trainer.init_state(params)}
    x, y = trainer.put_batch(inputs), trainer.put_batch(targets)

    def step():
        state["s"], m = trainer.step_fn(state["s"], x, y)
        jax.block_until_ready(m["loss"])
        return float(m["loss"])

    return step


def make_torch(cfg, sd, inputs, targets, precision: str, compiled: bool):
    """HF GPT2LMHeadModel + torch AdamW (foreach, two param groups as jaxpar's decay mask) +
    clip_grad_norm_; logits upcast to fp32 before the loss, as jaxpar's policy does."""
    import torch
    import torch.nn.functional as F

    from gpt2common.hf import hf_config_dict
    from torchref.model import build_model, decays

    model = build_model(hf_config_dict(cfg.model), sd)
    tc = cfg.train
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": tc.weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=True)
    x = torch.from_numpy(inputs.astype(np.int64))
    y = torch.from_numpy(targets.astype(np.int64))
    V = cfg.model.vocab_size

    def loss_of(x, y):
        logits = model(input_ids=x).logits  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1))

    fwd = torch.compile(loss_of) if compiled else loss_of
    bf16 = precision == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


# ----------------------------------------------------------------------------- driver


def fail(line: str):
    """Bad flags: one line on stderr, exit 2 (the repository's CLI contract), no traceback."""
    print(line, file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> dict:
    args = parse_args(argv)
    precisions = [s for s in args.precisions.split(",") if s]
    impls = [s for s in args.impls.split(",") if s]
    configs = [s for s in args.configs.split(",") if s]
    for flag, got, allowed in (("--precisions", precisions, ("fp32", "bf16")), ("--impls", impls, IMPLS),
                               ("--configs", configs, (*CONFIGS, "custom"))):
        bad = [s for s in got if s not in allowed]
        if bad or not got:
            fail(f"error: {flag} {','.join(bad) or '(empty)'}: expected a comma list of {','.join(allowed)}")
    for flag, value, least in (("--rounds", args.rounds, 1), ("--block", args.block, 1), ("--settle", args.settle, 0),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            fail(f"error: {flag} {value}: must be >= {least}")

    if args.host_memory == "both":
        return run_both(argv, args, precisions, impls)

    from jaxpar.run.host_memory import keep_freed_memory

    # as `jaxpar train` does before JAX starts (the torch contenders of this process share it)
    kept = keep_freed_memory() if args.host_memory == "keep" else False
    import jax
    import torch

    from jaxpar import tolerances

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    load_before = os.getloadavg()
    report = {
        "env": {"jax": jax.__version__, "torch": torch.__version__, "threads": threads,
                "cpu_count": os.cpu_count(), "cpu_model": tolerances.cpu_model(), "cpu_flags": cpu_flags(), "jax_devices": str(jax.devices()),
                "platform": platform.platform(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "loadavg_before": load_before, "torch_native_bf16": native_bf16,
                "host_memory": args.host_memory, "host_memory_kept": kept},
        "configs": {},
    }
    for name in configs:
        dims = CONFIGS.get(name) or (args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq, args.batch)
        rep = run_config(args, dims, precisions, impls, native_bf16)
        report["configs"][name] = rep
        print_table(name, rep, precisions, impls, threads)
        report["env"]["loadavg_after"] = os.getloadavg()
        report["env"]["process_cpu_s"] = time.process_time()  # whole process so far (>= every step's sum)
        if args.out:  # after every configuration, so a long run leaves what it finished
            write_report(report, args.out)
    return report


def run_config(args, dims, precisions, impls, native_bf16) -> dict:
    """Build every contender for one configuration, then time them interleaved."""
    from gpt2common.hf import to_hf_state_dict
    from jaxpar.models.gpt2 import init_params

    _, _, _, vocab, seq, batch = dims
    mc = config_of(dims, "fp32").model
    params = init_params(mc, args.seed)
    sd = to_hf_state_dict(mc, params)
    rng = np.random.default_rng(args.seed)
    toks = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int64).astype(np.int32)
    inputs, targets = toks[:, :-1], toks[:, 1:]

    contenders: dict[str, object] = {}
    compile_s: dict[str, float] = {}
    first_loss: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for prec in precisions:
        cfg = config_of(dims, prec, args.seed)
        for impl in impls:
            name = f"{impl}/{prec}"
            if impl != "jaxpar" and prec == "bf16" and (
                    args.torch_bf16 == "skip" or (args.torch_bf16 == "auto" and not native_bf16)):
                skipped[name] = ("--torch-bf16 skip" if args.torch_bf16 == "skip" else
                                 "no native bf16 matmul in torch on this CPU; run with --torch-bf16 full")
                print(f"[skip] {name}: {skipped[name]}", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            if impl == "jaxpar":
                step = make_jaxpar(cfg, params, inputs, targets)
            else:
                step = make_torch(cfg, sd, inputs, targets, prec, compiled=impl == "torch_compile")
            first_loss[name] = step()  # compiles
            compile_s[name] = time.perf_counter() - t0
            for _ in range(args.warmup):
                step()
            contenders[name] = step
            print(f"[warm] {name}: first step (incl. compile) {compile_s[name]:.1f}s, loss {first_loss[name]:.4f}",
                  file=sys.stderr, flush=True)

    times: dict[str, list[float]] = {n: [] for n in contenders}
    # process CPU time (all threads) per step: on a shared box other jobs stretch wall time far
    # more than the CPU time a step burns, so this is the steadier A/B figure there
    cpu: dict[str, list[float]] = {n: [] for n in contenders}
    settle: dict[str, list[float]] = {n: [] for n in contenders}
    for n, timed in schedule(list(contenders), args.rounds, args.block, args.settle):
        t0, c0 = time.perf_counter(), time.process_time()
        contenders[n]()
        (times[n] if timed else settle[n]).append(time.perf_counter() - t0)
        if timed:
            cpu[n].append(time.process_time() - c0)

    tokens = batch * seq
    fpt = mc.flops_per_token(seq)
    results = {}
    for n, ts in times.items():
        med = statistics.median(ts)
        q = np.percentile(ts, [10, 90]) if len(ts) > 1 else (ts[0], ts[0])
        results[n] = {"median_s": med, "p10_s": float(q[0]), "p90_s": float(q[1]), "times_s": ts,
                      "tokens_per_s": tokens / med, "gflops_per_s": fpt * tokens / med / 1e9,
                      "first_step_s": compile_s[n], "first_loss": first_loss[n],
                      "cpu_s": cpu[n], "cpu_median_s": statistics.median(cpu[n]), "settle_s": settle[n]}
    return {
        "config": {"n_layer": mc.n_layer, "n_embd": mc.n_embd, "n_head": mc.n_head, "vocab_size": mc.vocab_size,
                   "seq_len": seq, "batch": batch, "tokens_per_step": tokens,
                   "flops_per_token": fpt, "warmup": args.warmup, "rounds": args.rounds,
                   "block": args.block, "settle": args.settle},
        "skipped": skipped,
        "results": results,
        "ratios": ratios_of(results, precisions, impls),  # torch median / jaxpar median: > 1 means jaxpar is faster
        "loadavg_end": os.getloadavg(),
    }


def schedule(names: list[str], rounds: int, block: int, settle: int) -> list[tuple[str, bool]]:
    """The interleaved step order: (contender, timed) pairs. Turns of `settle` untimed then up to
    `block` timed steps of one contender; the turn order rotates by one each pass, so no contender
    always runs right after the same neighbour; every contender gets exactly `rounds` timed steps."""
    order: list[tuple[str, bool]] = []
    left = dict.fromkeys(names, rounds)
    p = 0
    while any(left.values()):
        for n in names[p % len(names):] + names[: p % len(names)]:
            k = min(block, left[n])
            order += [(n, False)] * (settle if k else 0) + [(n, True)] * k
            left[n] -= k
        p += 1
    return order


def ratios_of(results: dict, precisions, impls) -> dict:
    """torch median / jaxpar median per precision and torch contender (> 1: jaxpar faster)."""
    ratios = {}
    for prec in precisions:
        j = results.get(f"jaxpar/{prec}")
        for impl in impls:
            if impl != "jaxpar" and j and f"{impl}/{prec}" in results:
                ratios[f"{prec}/vs_{impl}"] = results[f"{impl}/{prec}"]["median_s"] / j["median_s"]
    if "jaxpar/fp32" in results and "jaxpar/bf16" in results:  # AVX2 target: bf16 >= jaxpar's own fp32
        ratios["bf16/vs_jaxpar_fp32"] = results["jaxpar/fp32"]["median_s"] / results["jaxpar/bf16"]["median_s"]
    return ratios


def merge_runs(keep: dict, default: dict, precisions, impls) -> dict:
    """One report from the `--host-memory keep` and `default` runs: jaxpar's figures from keep
    (what `jaxpar train` runs), each torch contender's from the run where its median was lower."""
    out = {"env": {**keep["env"], "host_memory": "both", "default_run_env": default["env"]}, "configs": {}}
    for name, k in keep["configs"].items():
        d = default["configs"][name]["results"]
        results = {}
        for n, r in k["results"].items():
            other = d.get(n)
            use_default = not n.startswith("jaxpar/") and other is not None and other["median_s"] < r["median_s"]
            results[n] = {**(other if use_default else r), "host_memory": "default" if use_default else "keep",
                          "median_s_keep": r["median_s"], "median_s_default": other and other["median_s"]}
        out["configs"][name] = {**k, "results": results, "ratios": ratios_of(results, precisions, impls),
                                "loadavg_end_default_run": default["configs"][name]["loadavg_end"]}
    return out


def run_both(argv, args, precisions, impls) -> dict:
    """`--host-memory both`: this script once per setting (keep first), then `merge_runs`."""
    import subprocess
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("keep", "default"):
            out = os.path.join(tmp, f"{mode}.json")
            print(f"[host-memory={mode}] running the benchmark in its own process", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--host-memory", mode, "--out", out],
                           check=True)
            with open(out) as f:
                runs[mode] = json.load(f)
    report = merge_runs(runs["keep"], runs["default"], precisions, impls)
    threads = report["env"]["threads"]
    print("merged: jaxpar from host-memory=keep, each torch contender from its faster run (last column)")
    for name, rep in report["configs"].items():
        print_table(name, rep, precisions, impls, threads)
    if args.out:
        write_report(report, args.out)
    return report


def write_report(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")


def print_table(name, rep, precisions, impls, threads):
    c = rep["config"]
    print(f"[{name}] GPT-2 L={c['n_layer']} D={c['n_embd']} H={c['n_head']} V={c['vocab_size']} B={c['batch']} "
          f"T={c['seq_len']}; median of {c['rounds']} steps, interleaved in turns of {c.get('settle', 0)} untimed + "
          f"{c.get('block', 1)} timed; threads={threads}")
    print(f"{'contender':<22}{'median s':>10}{'p10':>8}{'p90':>8}{'tok/s':>9}{'GFLOP/s':>9}{'jaxpar x':>10}")
    for prec in precisions:
        for impl in impls:
            n = f"{impl}/{prec}"
            if n not in rep["results"]:
                continue
            r = rep["results"][n]
            x = rep["ratios"].get(f"{prec}/vs_{impl}")
            ratio = "" if impl == "jaxpar" else "-" if x is None else f"{x:.2f}x"
            print(f"{n:<22}{r['median_s']:>10.3f}{r['p10_s']:>8.3f}{r['p90_s']:>8.3f}{r['tokens_per_s']:>9.0f}"
                  f"{r['gflops_per_s']:>9.1f}{ratio:>10}  {r.get('host_memory', '')}")
    print("jaxpar x = torch median / jaxpar median (> 1: jaxpar faster)", flush=True)


if __name__ == "__main__":
    main()
