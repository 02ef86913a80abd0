"""The PyTorch peer of benchmarks/gpu_mfu.py: a nanoGPT-style GPT-2 train step on the same shapes.

    python benchmarks/torch_peer.py [--models gpt2,gpt2-medium] [--batch 16,8] [--seq 1024]
                                    [--compile 1] [--device cuda] [--out F.json]

The step is what a careful PyTorch user writes for one GPU (nanoGPT's train.py): bf16 autocast,
`F.scaled_dot_product_attention` (flash attention on the GPU), the head tied to the token
embedding, the loss in fp32, AdamW with `fused=True` on CUDA, clip 1.0 and `torch.compile`.
It is timed like jaxpar's: the median of `--steps` steps after `--warmup` untimed ones (compile
included there), each synchronised by reading its loss (`loss.item()`). The model has exactly
`ModelConfig.num_params()` parameters, so MFU uses jaxpar's own FLOPs per token (6N + 12·L·H·Q·T,
N without wpe) and the peak the caller passes.
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gpt2common.model import PRESETS, ModelConfig  # noqa: E402


class Block(nn.Module):
    """Pre-LN block: x + attn(ln1 x), then + mlp(ln2 x); (B, T, D) -> (B, T, D)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        # (B, T, D) -> (B, N, T, Hd) for SDPA, back to (B, T, D)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 with a tied head; forward(idx, targets) -> mean fp32 cross-entropy."""

    def __init__(self, mc: ModelConfig):
        super().__init__()
        L, d = mc.n_layer, mc.n_embd
        self.wte, self.wpe = nn.Embedding(mc.vocab_size, d), nn.Embedding(mc.n_positions, d)
        self.blocks = nn.ModuleList(Block(d, mc.n_head) for _ in range(L))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, mc.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)
                nn.init.normal_(p, 0, 0.02 / (math.sqrt(2 * L) if name.endswith(("proj.weight", "out.weight")) else 1))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def make_step(mc: ModelConfig, batch: int, seq: int, device: str, compile_: bool, seed: int = 0):
    """(model, step) where step() runs one train step on a fixed random (batch, seq) batch and
    returns its loss as a float (the synchronisation point)."""
    torch.manual_seed(seed)
    if device == "cuda":  # nanoGPT's setting; under bf16 autocast it touches only fp32 leftovers
        torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(mc).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda")
    fwd = torch.compile(model) if compile_ else model
    idx = torch.randint(0, mc.vocab_size, (batch, seq + 1), device=device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def rates(mc: ModelConfig, batch: int, seq: int, median_s: float, peak_flops: float) -> dict:
    """tokens/s, TFLOP/s and MFU of a (batch, seq) step taking `median_s`, with jaxpar's FLOPs per
    token; both sides of gpu_mfu.py's comparison use it."""
    tokens = batch * seq
    flops = mc.flops_per_token(seq) * tokens / median_s
    return {"tokens_per_s": tokens / median_s, "tflops_per_s": flops / 1e12, "peak_tflops": peak_flops / 1e12,
            "mfu": flops / peak_flops}


def measure(model: str, batch: int, seq: int, steps: int, warmup: int, compile_: bool, device: str,
            peak_flops: float) -> dict:
    """One row, keyed like gpu_mfu.measure's: median step time, tokens/s, TFLOP/s, MFU."""
    mc = PRESETS[model]
    m, step = make_step(mc, batch, seq, device, compile_)
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"model": model, "batch": batch, "seq": seq, "compile": compile_, "device": device,
            "params": sum(p.numel() for p in m.parameters()), "median_step_s": med, "warmup_s": warm,
            "times_s": times, "losses": losses, **rates(mc, batch, seq, med, peak_flops)}


def line(r: dict) -> str:
    return (f"torch  {r['model']:<12} B={r['batch']:<3} T={r['seq']}  {r['median_step_s'] * 1e3:8.1f} ms/step  "
            f"{r['tokens_per_s']:9.0f} tok/s  {r['tflops_per_s']:6.1f} TFLOP/s  MFU {100 * r['mfu']:.1f}%  "
            f"(compile={int(r['compile'])}, warm-up {r['warmup_s']:.0f} s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,gpt2-medium")
    p.add_argument("--batch", default="16,8")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    rows = []
    for model, b in zip(a.models.split(","), a.batch.split(","), strict=True):
        rows.append(measure(model, int(b), a.seq, a.steps, a.warmup, bool(a.compile), a.device, a.peak_tflops * 1e12))
        print(line(rows[-1]), flush=True)
        if a.out:  # after each model, so a timeout keeps what was measured
            with open(a.out, "w") as f:
                json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
