"""Property-based parity: the draw space (hypothesis) and one example's run in both frameworks.

An example is one training configuration drawn over the whole space `jaxpar train` and
`torchref train` share, plus a jaxpar mesh and a torchref strategy:

  model      n_layer 1-4, n_head 1-5 with head_dim 8-24, vocab 50-300 (odd sizes too),
             n_positions = seq_len + 0..16, layer_norm_epsilon
  train      batch_size, seq_len 4-32, steps 1-12, warmup_steps 0-15 (often > steps), lr,
             min_lr_ratio, weight_decay, beta1, beta2, eps, grad_clip in {0 (off), 1e-6 (always
             clips), 1e6 (never clips)}, grad_accum 1-4, remat, vocab_chunks, mlp_chunks; seed
  jaxpar     a (data, fsdp, tensor, pipe) mesh of 1-8 of the 8 emulated devices that jaxpar's own
             checks accept for the drawn shape (pipeline.microbatches, schedule gpipe|circular|
             1f1b|zb|interleaved, repeats), sequence parallelism where tensor divides seq_len,
             sharding.replicate groups, precision=fp32
  torchref   single, or single-ps | distributed-ps | horovod with 2 or 4 workers (the
             synchronous fp32 strategies); `horovod` only when `slow` (mpiexec starts cost ~10 s)

Both sides start from the shared numpy init of (model, seed) — `jaxpar train` without `init=`
and torchref's `initial_state_dict` — and read one prepared dir of uniform random token ids of
the drawn vocab. Asserted per step: loss and logged pre-clip grad norm within the fp32 bounds of
`parity_tests/tolerances.py`. A failing example's message is a ready-to-paste command triple:
write the data, `jaxpar train ...`, `torchref train ...`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck
from hypothesis import strategies as st

from jaxpar.config import Config, ConfigError, MeshConfig, ModelConfig, PipelineConfig, TrainConfig
from jaxpar.train import check_model_vs_mesh
from parity_tests.tolerances import TRAJECTORY

BOUNDS = TRAJECTORY["fp32"]  # loss_rel, grad_rel (the grad-norm trajectory is judged by grad_rel)
ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
MAX_BATCH = 32
# Keys of `jaxpar train` this space varies (parity_tests/test_key_policy.py checks every mirrored
# or same-math key of train.* and model.* is among them or has a reason not to be).
DRAWN_KEYS = {
    "model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size", "model.n_positions",
    "model.layer_norm_epsilon", "sharding.replicate",
    "train.steps", "train.batch_size", "train.seq_len", "train.lr", "train.min_lr_ratio", "train.warmup_steps",
    "train.weight_decay", "train.beta1", "train.beta2", "train.eps", "train.grad_clip", "train.grad_accum",
    "train.remat", "train.vocab_chunks", "train.mlp_chunks", "model.attention", "seed", "data",
    "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.pipe", "pipeline.microbatches", "pipeline.schedule",
    "pipeline.repeats", "tensor.sequence_parallel",
}


# Parts of the space left out of the draw, with the reason (listed in the report, never silent).
EXCLUDED = {
    "torchref -amp strategies, ps.async=true": "not fp32 / not synchronous: bounded by the bf16 rows of the matrix "
    "or not step-comparable (parity_tests.matrix.EXCLUDED)",
    "model.dropout>0": "torchref rejects it (its dropout masks cannot be jaxpar's)",
}


@dataclass(frozen=True)
class Example:
    common: tuple[str, ...]  # keys both CLIs get (model, train, seed); data= is added per run
    vocab: int
    jaxpar: tuple[str, ...]  # mesh.* / pipeline.* / memory knobs
    torchref: tuple[str, ...]  # strategy=, workers=

    def summary(self) -> str:
        """One short line for the report: shape | optimizer | jaxpar layout | torchref strategy."""
        kv = dict(a.split("=", 1) for a in self.common + self.jaxpar + self.torchref)
        g = lambda k: kv[k]  # noqa: E731
        pipe = (f" mb={g('pipeline.microbatches')} {g('pipeline.schedule')}×{g('pipeline.repeats')}"
                if g("mesh.pipe") != "1" else "")
        return (f"L{g('model.n_layer')} H{g('model.n_head')} D{g('model.n_embd')} V{g('model.vocab_size')} "
                f"P{g('model.n_positions')} ln {float(g('model.layer_norm_epsilon')):.0e} | B{g('train.batch_size')} T{g('train.seq_len')} "
                f"steps {g('train.steps')} wu {g('train.warmup_steps')} lr {float(g('train.lr')):.2g} "
                f"r {float(g('train.min_lr_ratio')):.2g} wd {float(g('train.weight_decay')):.2g} "
                f"b {float(g('train.beta1')):.2f}/{float(g('train.beta2')):.3f} eps {float(g('train.eps')):.0e} "
                f"clip {float(g('train.grad_clip')):g} accum {g('train.grad_accum')} seed {g('seed')} | "
                f"d{g('mesh.data')} f{g('mesh.fsdp')} t{g('mesh.tensor')} p{g('mesh.pipe')}{pipe} "
                f"remat {g('train.remat')} vc {g('train.vocab_chunks')} mc {g('train.mlp_chunks')}"
                f"{' repl ' + kv['sharding.replicate'] if 'sharding.replicate' in kv else ''}"
                f"{' sp' if kv.get('tensor.sequence_parallel') == 'true' else ''} | "
                f"{g('strategy')}×{g('workers')}")

    def data_dir(self, root: str) -> str:
        return os.path.join(root, f"data_v{self.vocab}")

    def commands(self, root: str) -> str:
        """The ready-to-paste reproduction: write the data, then the two CLI runs."""
        d = self.data_dir(root)
        common = " ".join(self.common) + f" data={d}"
        return (f"python -c \"from parity_tests.common import write_data; write_data('{d}', {self.vocab}, 20000)\"\n"
                f"jaxpar train {common} {' '.join(self.jaxpar)} precision=fp32 train.eval_every=0 out=/tmp/px_jax\n"
                f"torchref train {common} {' '.join(self.torchref)} out=/tmp/px_torch")


# hypothesis settings of the property set (test and report): reproducible draws, no deadline
# (an example compiles a program), no example database in the checkout.
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW_EXAMPLES = 40


# (pipeline.schedule, pipeline.repeats) drawn for pipe > 1: every schedule, the chunked ones with 2 chunks
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("zb", 1), ("interleaved", 2))


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, cap + 1) if n % d == 0]


@functools.cache
def _meshes(n_layer: int, n_head: int, n_embd: int, vocab: int) -> list[dict]:
    """(data, fsdp, tensor, pipe, microbatches, schedule, repeats) jaxpar's checks accept for this
    shape on <= 8 devices, ignoring the batch (drawn after the mesh so that it divides)."""
    with contextlib.redirect_stderr(io.StringIO()):  # nothing is printed (warnings ride on the layout); kept as a guard
        return _valid_meshes(n_layer, n_head, n_embd, vocab)


def _valid_meshes(n_layer: int, n_head: int, n_embd: int, vocab: int) -> list[dict]:
    mc = ModelConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=64)
    out = []
    for data in (1, 2, 4, 8):
        for fsdp in (1, 2, 4, 8):
            for tensor in (1, 2, 4):
                for pipe in (1, 2, 4):
                    if data * fsdp * tensor * pipe > DEVICES:
                        continue
                    pipes = [(1, "gpipe", 1)] if pipe == 1 else [
                        (m, s, r) for m in (1, 2, 4) for s, r in SCHEDULES]
                    for m, s, r in pipes:
                        cfg = Config(model=mc, mesh=MeshConfig(data, fsdp, tensor, pipe),
                                     pipeline=PipelineConfig(microbatches=m, schedule=s, repeats=r),
                                     train=TrainConfig(batch_size=64 * m, grad_accum=1))
                        try:
                            check_model_vs_mesh(mc, cfg)
                        except ConfigError:
                            continue
                        out.append({"data": data, "fsdp": fsdp, "tensor": tensor, "pipe": pipe, "mb": m,
                                    "schedule": s, "repeats": r})
    return out


def _fmt(x: float) -> str:
    return repr(float(x))


@st.composite
def examples(draw, slow: bool = False) -> Example:
    n_layer = draw(st.integers(1, 4))
    n_head = draw(st.integers(1, 5))
    n_embd = n_head * draw(st.integers(8, 24))
    # odd sizes, and multiples of 4 often enough that tensor-parallel meshes (vocab % tensor) come up
    vocab = draw(st.integers(50, 300) | st.integers(13, 75).map(lambda k: 4 * k))
    mesh = draw(st.sampled_from(_meshes(n_layer, n_head, n_embd, vocab)))
    strategy = draw(st.sampled_from(["single", "single-ps", "distributed-ps"] + (["horovod"] if slow else [])))
    workers = 1 if strategy == "single" else draw(st.sampled_from([2, 4]))
    dp = mesh["data"] * mesh["fsdp"] * (mesh["mb"] if mesh["pipe"] > 1 else 1)  # <= 16: accum=1 always fits
    # global batch: a multiple of both sides' row unit, at most MAX_BATCH rows
    accum = draw(st.sampled_from([a for a in range(1, 5) if math.lcm(dp * a, workers * a) <= MAX_BATCH]))
    unit = math.lcm(dp * accum, workers * accum)
    batch = unit * draw(st.integers(1, MAX_BATCH // unit))
    seq_len = draw(st.integers(4, 32))
    steps = draw(st.integers(1, 12))
    common = [
        "model=gpt2-tiny", f"model.n_layer={n_layer}", f"model.n_head={n_head}", f"model.n_embd={n_embd}",
        f"model.vocab_size={vocab}", f"model.n_positions={seq_len + draw(st.integers(0, 16))}",
        f"model.layer_norm_epsilon={_fmt(draw(st.sampled_from([1e-5, 1e-6, 1e-3])))}",
        f"train.batch_size={batch}", f"train.seq_len={seq_len}", f"train.steps={steps}",
        f"train.warmup_steps={draw(st.integers(0, 15))}",
        f"train.lr={_fmt(draw(st.floats(1e-4, 3e-3)))}",
        f"train.min_lr_ratio={_fmt(draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0.0, 1.0)))}",
        f"train.weight_decay={_fmt(draw(st.floats(0.0, 0.3)))}",
        f"train.beta1={_fmt(draw(st.floats(0.5, 0.95)))}", f"train.beta2={_fmt(draw(st.floats(0.9, 0.999)))}",
        f"train.eps={_fmt(draw(st.sampled_from([1e-8, 1e-7, 1e-6])))}",
        f"train.grad_clip={_fmt(draw(st.sampled_from([0.0, 1e-6, 1e6])))}",
        f"train.grad_accum={accum}", f"seed={draw(st.integers(0, 2**16))}",
    ]
    jx = [f"mesh.{k}={mesh[k]}" for k in ("data", "fsdp", "tensor", "pipe")]
    if mesh["pipe"] > 1:
        jx += [f"pipeline.microbatches={mesh['mb']}", f"pipeline.schedule={mesh['schedule']}",
               f"pipeline.repeats={mesh['repeats']}"]
    if mesh["tensor"] > 1 and seq_len % mesh["tensor"] == 0:  # Megatron SP: T split over `tensor`
        jx.append(f"tensor.sequence_parallel={draw(st.booleans())}".lower())
    replicate = draw(st.lists(st.sampled_from(["embed", "attn", "mlp"]), unique=True, max_size=2))
    if replicate:  # per-group OSDP: these groups stay whole over fsdp
        jx.append(f"sharding.replicate={','.join(replicate)}")
    # pipe > 1 with mlp_chunks > 1 was excluded until its scan-carry bug (found here) was fixed in jaxpar/models/chunked.py
    mlp_chunks = _divisors(4 * n_embd, 4)
    jx += [f"model.attention={draw(st.sampled_from(['auto', 'xla']))}",  # cudnn needs a GPU
           f"train.remat={draw(st.sampled_from(['none', 'selective', 'full']))}",
           f"train.vocab_chunks={draw(st.sampled_from(_divisors(seq_len, 4)))}",
           f"train.mlp_chunks={draw(st.sampled_from(mlp_chunks))}"]
    return Example(tuple(common), vocab, tuple(jx), (f"strategy={strategy}", f"workers={workers}"))


# ----------------------------------------------------------------------------- running


class JaxRuns:
    """The persistent 8-device jaxpar worker (`parity_tests.jax_runs`), started on first use."""

    _proc: subprocess.Popen | None = None

    @classmethod
    def run(cls, args: list[str], log: str) -> dict:
        cls.submit(args, log)
        return cls.result(log)

    @classmethod
    def submit(cls, args: list[str], log: str) -> None:
        """Send one run; the worker computes while the caller does something else (torchref)."""
        if cls._proc is None or cls._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            # backend optimisation level 0: the programs are tiny, XLA's CPU compile time dominates
            # (tests/parallel/test_sharding_equivalence.py does the same); HLO-level fusion is unchanged.
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} "
                       "--xla_backend_optimization_level=0",
                       PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
            cls._proc = subprocess.Popen([sys.executable, "-m", "parity_tests.jax_runs"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=open(log, "a"), text=True, env=env,  # noqa: SIM115
                                         cwd=ROOT)
            atexit.register(cls.close)
        cls._proc.stdin.write(json.dumps({"args": args}) + "\n")
        cls._proc.stdin.flush()

    @classmethod
    def result(cls, log: str) -> dict:
        line = cls._proc.stdout.readline()
        if not line:
            cls._proc = None
            return {"error": f"parity_tests.jax_runs died (log: {log})"}
        return json.loads(line)

    @classmethod
    def close(cls) -> None:
        if cls._proc is not None and cls._proc.poll() is None:
            cls._proc.stdin.close()
            cls._proc.wait(30)
        cls._proc = None


def run_torchref(args: list[str], out: str) -> dict:
    """`torchref train` in this process (its launcher forks the ranks from the warm zygote)."""
    import contextlib
    import io
    import shutil

    from jaxpar.config import ConfigError
    from torchref import launch
    from torchref.config import WorkerDied, resolve_ref

    shutil.rmtree(out, ignore_errors=True)
    try:
        cfg, ref = resolve_ref(args + [f"out={out}", "train.log_every=0"])
        with contextlib.redirect_stdout(io.StringIO()):
            launch.train(cfg, ref)
    except (ConfigError, WorkerDied) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    recs = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"losses": [r["loss"] for r in recs], "grad_norms": [r["grad_norm"] for r in recs]}


def compare(jx: dict, tr: dict) -> dict:
    """Max relative per-step diffs of loss and grad norm, and whether they are within BOUNDS."""
    if "error" in jx or "error" in tr:
        return {"pass": False, "error": jx.get("error") or tr.get("error")}
    n = len(tr["losses"])
    if len(jx["losses"]) != n:
        return {"pass": False, "error": f"{len(jx['losses'])} jaxpar steps vs {n} torchref steps"}
    rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))  # noqa: E731
    loss_rel, gn_rel = rel(jx["losses"], tr["losses"]), rel(jx["grad_norms"], tr["grad_norms"])
    # every value finite: max() over the steps skips a nan that is not the first value (nan > x is False)
    finite = all(math.isfinite(v) for v in jx["losses"] + tr["losses"] + jx["grad_norms"] + tr["grad_norms"])
    return {"pass": finite and loss_rel <= BOUNDS["loss_rel"] and gn_rel <= BOUNDS["grad_rel"],
            "max_loss_rel": loss_rel, "max_grad_norm_rel": gn_rel, "steps": n,
            "losses_jaxpar": jx["losses"], "losses_torchref": tr["losses"]}


def run_example(ex: Example, root: str) -> dict:
    """Both sides of one example (data written once per vocab under `root`). Returns compare()."""
    from parity_tests.common import write_data

    data = write_data(ex.data_dir(root), ex.vocab, 20000)
    common = list(ex.common) + [f"data={data}"]
    log = os.path.join(root, "jax_runs.log")
    JaxRuns.submit(common + list(ex.jaxpar) + ["precision=fp32"], log)  # both sides at once
    tr = run_torchref(common + list(ex.torchref), os.path.join(root, "torchref_run"))
    jx = JaxRuns.result(log)
    return {**compare(jx, tr), "compile_s": jx.get("compile_s")}


def run_set(root: str, n: int = SLOW_EXAMPLES, log=print) -> list[dict]:
    """The property set without stopping at a failure (for the report): `n` drawn examples."""
    from hypothesis import given, settings

    results: list[dict] = []

    @settings(max_examples=n, **SETTINGS)
    @given(ex=examples(slow=True))
    def one(ex):
        res = run_example(ex, root)
        results.append({"config": ex.summary(), **res, "commands": ex.commands(root)})
        verdict = "PASS" if res["pass"] else f"FAIL {res.get('error', '')}"
        log(f"[property] {len(results)}/{n} {ex.summary()}: {verdict} "
            f"(loss {res.get('max_loss_rel', float('nan')):.1e}, grad norm {res.get('max_grad_norm_rel', float('nan')):.1e})")

    one()
    return results
