"""Model FLOPs utilisation of the jaxpar train step on one GPU: GPT-2 124M and 350M, bf16, seq 1024,
side by side with the nanoGPT-style PyTorch step on the same shapes in the same run.

    python benchmarks/gpu_mfu.py [--models gpt2,gpt2-medium] [--batch 16,8] [--steps 10] [--warmup 3]
                                 [--remat none] [--attention auto] [--vocab-chunks 1] [--torch compile|eager|off]
                                 [--out benchmarks/results/gpu_mfu.json]

One timed step = the real `build_trainer` step (forward + backward + clip + AdamW, donated
state) on a 1-device mesh, synchronised on its loss; warm-up steps (compilation) excluded;
the median of `--steps` is reported. MFU = tokens/s x ModelConfig.flops_per_token(seq)
(6N + 12·L·H·Q·T, the same formula as `jaxpar train`) / the device's dense bf16 peak
(jaxpar.train.PEAK_FLOPS: H100 989 TFLOP/s). The GPU collective-overlap flags
(jaxpar/run/xla_flags.py) are applied as `jaxpar train` does. On a machine without a GPU it
refuses: one line on stderr, exit 2.

The PyTorch peer (benchmarks/torch_peer.py: bf16 autocast, SDPA flash attention, fused AdamW, clip
1.0, torch.compile unless `--torch eager`) runs first, on every shape, and releases its GPU memory
before JAX starts (JAX reserves most of the GPU when its backend starts). Each shape gets one
`side_by_side` entry: the two median steps and `speedup` = torch ms / jaxpar ms (above 1: jaxpar
faster), MFU of both with the same FLOPs per token and peak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_peer

from jaxpar.run import xla_flags  # noqa: E402

PRESET_BATCH = {"gpt2": 16, "gpt2-medium": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,gpt2-medium")
    p.add_argument("--batch", default="", help="comma list, one per model (default 16 for gpt2, 8 for gpt2-medium)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--remat", default="none", choices=("none", "selective", "full"))
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"))
    p.add_argument("--vocab-chunks", type=int, default=1, help="train.vocab_chunks: the loss in this many token chunks")
    p.add_argument("--torch", default="compile", choices=("compile", "eager", "off"),
                   help="the PyTorch peer: torch.compile'd, eager, or not run")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_mfu.json"))
    return p.parse_args(argv)


def start_gpu(script: str, what: str) -> bool:
    """Start JAX on the GPU with jaxpar's GPU XLA flags (`jaxpar train` does the same), for this and
    the other GPU benchmarks (gpu_check.py, gpu_profile.py). Where there is no GPU: one `error:` line
    on stderr naming `script` and `what` it does, and False; the first check runs before JAX starts."""
    if not xla_flags.has_nvidia_gpu():
        print(f"error: {script} {what} and needs an NVIDIA GPU (none here: no /dev/nvidia*, no nvidia-smi, "
              f"or JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r})", file=sys.stderr)
        return False
    xla_flags.apply_gpu_defaults()  # before JAX starts
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        print(f"error: {script} {what} and needs a GPU (jax backend: {backend}, devices: "
              f"{', '.join(sorted({d.device_kind for d in jax.devices()}))})", file=sys.stderr)
        return False
    return True


def preset_step(model: str, batch: int, seq: int, attention: str = "auto", remat: str = "none", vocab_chunks: int = 1):
    """(cfg, trainer, state, x, y): the real bf16 `build_trainer` step of preset `model` on one
    device, seed-0 weights and a random (batch, seq) batch."""
    import dataclasses

    import jax
    import numpy as np

    from jaxpar.config import PRESETS, Config, TrainConfig
    from jaxpar.models.gpt2 import init_params
    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer

    mc = dataclasses.replace(PRESETS[model], attention=attention)
    cfg = Config(model=mc, model_name=model, precision="bf16",
                 train=TrainConfig(batch_size=batch, seq_len=seq, remat=remat, vocab_chunks=vocab_chunks))
    trainer = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
    state = trainer.init_state(init_params(mc, 0))
    toks = np.random.default_rng(0).integers(0, mc.vocab_size, (batch, seq + 1)).astype(np.int32)
    return cfg, trainer, state, trainer.put_batch(toks[:, :-1]), trainer.put_batch(toks[:, 1:])


def write_json(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")


def shapes(args) -> list[tuple[str, int]]:
    """(model, batch) pairs: --batch one per model, else PRESET_BATCH (8 for other presets)."""
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [PRESET_BATCH.get(m, 8) for m in models]
    if len(batches) != len(models):
        print(f"error: --batch {args.batch} gives {len(batches)} batch sizes for {len(models)} models", file=sys.stderr)
        raise SystemExit(2)
    return list(zip(models, batches, strict=True))


def side_by_side(jax_row: dict, torch_row: dict, peak_flops: float) -> dict:
    """One shape's comparison: both median steps, speedup = torch / jaxpar step time, both MFUs
    at `peak_flops` (the torch row's own MFU is recomputed here at jaxpar's peak)."""
    from torch_peer import rates

    from gpt2common.model import PRESETS

    assert (jax_row["model"], jax_row["batch"], jax_row["seq"]) == (torch_row["model"], torch_row["batch"],
                                                                    torch_row["seq"]), (jax_row, torch_row)
    torch_row.update(rates(PRESETS[torch_row["model"]], torch_row["batch"], torch_row["seq"],
                           torch_row["median_step_s"], peak_flops))
    return {"model": jax_row["model"], "batch": jax_row["batch"], "seq": jax_row["seq"],
            "jaxpar_ms": jax_row["median_step_s"] * 1e3, "torch_ms": torch_row["median_step_s"] * 1e3,
            "speedup": torch_row["median_step_s"] / jax_row["median_step_s"],
            "jaxpar_mfu": jax_row["mfu"], "torch_mfu": torch_row["mfu"], "torch_compile": torch_row["compile"]}


def torch_rows(pairs, args) -> list[dict]:
    """The PyTorch peer on every shape, before JAX starts; its cached GPU memory released after."""
    import torch
    import torch_peer

    if not torch.cuda.is_available():
        print(f"error: gpu_mfu.py --torch {args.torch} needs torch with CUDA (torch {torch.__version__} has none "
              "here); --torch off times jaxpar alone", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    for model, batch in pairs:
        r = torch_peer.measure(model, batch, args.seq, args.steps, args.warmup, args.torch == "compile", "cuda",
                               math.nan)
        rows.append(r)
        print(f"torch  {model:<12} B={batch:<3} T={args.seq}  {r['median_step_s'] * 1e3:8.1f} ms/step  "
              f"(compile={int(r['compile'])}, warm-up {r['warmup_s']:.0f} s)", flush=True)
    torch.cuda.empty_cache()
    return rows


def measure(model: str, batch: int, args) -> dict:
    from jaxpar.train import device_peak_flops

    cfg, trainer, state, x, y = preset_step(model, batch, args.seq, args.attention, args.remat, args.vocab_chunks)
    mc = cfg.model
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, m = trainer.step_fn(state, x, y)
        float(m["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = batch * args.seq
    peak = device_peak_flops(cfg)
    flops = mc.flops_per_token(args.seq) * tokens / med
    return {"model": model, "batch": batch, "seq": args.seq, "remat": args.remat, "attention": args.attention,
            "vocab_chunks": args.vocab_chunks,
            "median_step_s": med, "times_s": times, "tokens_per_s": tokens / med, "tflops_per_s": flops / 1e12,
            "peak_tflops": peak / 1e12 if peak else None, "mfu": flops / peak if peak else None}  # None: GPU not in the table


def _pct(x) -> str:
    """MFU as printed: a percentage, or n/a for a GPU whose peak the table does not know."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def compare(pairs, args, jax_rows: list[dict], peers: list[dict]) -> list[dict]:
    """side_by_side of each shape, printed; empty without the peer."""
    out = []
    for j, t in zip(jax_rows, peers, strict=False):
        s = side_by_side(j, t, j["peak_tflops"] * 1e12)
        out.append(s)
        print(f"jaxpar / torch ({'compiled' if s['torch_compile'] else 'eager'}) {s['model']:<12} B={s['batch']:<3} "
              f"T={s['seq']}  {s['jaxpar_ms']:.1f} vs {s['torch_ms']:.1f} ms/step  speedup {s['speedup']:.2f}x  "
              f"MFU {_pct(s['jaxpar_mfu'])} vs {_pct(s['torch_mfu'])}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    pairs = shapes(args)
    if not xla_flags.has_nvidia_gpu():
        start_gpu("gpu_mfu.py", "measures GPU MFU")  # the one-line refusal, before anything runs
        return 2
    peers = torch_rows(pairs, args) if args.torch != "off" else []
    if not start_gpu("gpu_mfu.py", "measures GPU MFU"):
        return 2
    import jax

    rows = []
    for model, batch in pairs:
        r = measure(model, batch, args)
        rows.append(r)
        print(f"{model:<12} B={batch:<3} T={args.seq}  {r['median_step_s'] * 1e3:8.1f} ms/step  "
              f"{r['tokens_per_s']:9.0f} tok/s  {r['tflops_per_s']:6.1f} TFLOP/s  MFU {_pct(r['mfu'])}", flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows, "torch_rows": peers,
              "side_by_side": compare(pairs, args, rows, peers)}
    if peers:
        import torch

        report["torch"] = torch.__version__
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
