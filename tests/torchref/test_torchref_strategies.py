"""Multi-process runs of the six strategies on gpt2-tiny (CPU, gloo / mpiexec), checked against
`single`: losses for 10 steps, gradients after step 1, byte counters vs the analytic volume,
async PS, AMP bounds, fp16 compression, and a dying worker. Tolerances: jaxpar/tolerances.py.
Every synchronous strategy is also checked against jaxpar (independent reference: the JAX
implementation, `tests/jaxpar_reference.py`) with the cross-framework table
(parity_tests/tolerances.py TRAJECTORY): losses of all 10 steps and every step-1 gradient.

Runs go through `torchref.launch.train` in this process, so forked ranks start with torch and
transformers already imported (the horovod ranks are started by mpiexec and import their own).
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from support.extras import require_mpiexec

from jaxpar.tolerances import GRAD_NORM_RTOL_AMP, GRAD_TOL_FP32, LOSS_RTOL_AMP, LOSS_RTOL_FP16_WIRE, LOSS_RTOL_FP32
from parity_tests.tolerances import TRAJECTORY

STEPS = 10
BASE = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.lr=1e-3", "debug.grad_step=1", "train.log_every=0"]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchref")
    data = {}
    cache = {}

    def run(*args):
        from torchref.config import resolve_ref
        from torchref.launch import train

        key = tuple(args)
        if key not in cache:
            out = root / f"run{len(cache)}"
            extra = [f"data={data['dir']}"] if data else []
            cfg, ref = resolve_ref(BASE + list(args) + extra + [f"out={out}"])
            s = train(cfg, ref)
            if not data:  # reuse the prepared corpus of the first run
                data["dir"] = os.path.join(out, "data")
            cache[key] = Run(out, s)
        return cache[key]

    return run


class Run:
    def __init__(self, out, summary):
        from safetensors.numpy import load_file

        self.out, self.summary = out, summary
        self.rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
        self.losses = np.array([r["loss"] for r in self.rows])
        g = os.path.join(out, "grads_step1.safetensors")
        self.grads = load_file(g) if os.path.exists(g) else None
        self.psi = summary["param_bytes"]


@pytest.fixture(scope="module")
def jaxpar_ref(runner, tmp_path_factory) -> dict:
    """jaxpar's 10 losses and step-1 gradients on the runs' config, init and prepared data."""
    from support import jaxpar_reference
    from support.cli_helpers import clean_env

    data = runner("strategy=single").out / "data"
    args = [a for a in BASE if not a.startswith(("debug.", "train.log_every"))]
    return jaxpar_reference.run(str(data), str(tmp_path_factory.mktemp("jaxpar") / "ref.npz"), args, clean_env())


def check_against_jaxpar(run: "Run", ref: dict, precision: str) -> None:
    """Losses of every step and every step-1 gradient within TRAJECTORY[precision] of jaxpar:
    fp32 gradients per tensor in max-norm, bf16 (AMP) ones per tensor in l2 (entries near zero
    carry no relative accuracy in bf16)."""
    tol = TRAJECTORY[precision]
    assert len(ref["losses"]) == len(run.losses) == STEPS
    loss = float(np.max(np.abs(run.losses - ref["losses"]) / ref["losses"]))
    assert loss <= tol["loss_rel"], (precision, loss)
    g, r = run.grads, ref["grads"]
    assert g.keys() == r.keys() and len(r) == 4 + 12 * 2
    if precision == "fp32":
        worst = max((float(np.max(np.abs(g[k] - r[k])) / np.max(np.abs(r[k]))), k) for k in r)
        assert worst[0] <= tol["grad_rel"], worst
    else:
        worst = max((float(np.linalg.norm(g[k] - r[k]) / np.linalg.norm(r[k])), k) for k in r)
        assert worst[0] <= tol["grad_l2_rel"], worst


def loss_rel(a: Run, b: Run) -> float:
    assert len(a.losses) == len(b.losses) == STEPS
    return float(np.max(np.abs(a.losses - b.losses) / b.losses))


def grad_rel(a: Run, b: Run) -> float:
    """max over tensors of max|g_a - g_b| / max|g_b|."""
    assert a.grads.keys() == b.grads.keys() and len(b.grads) == 4 + 12 * 2  # tiny: 2 layers, 12 tensors each
    return max(float(np.max(np.abs(a.grads[k] - b.grads[k])) / np.max(np.abs(b.grads[k]))) for k in b.grads)


def grad_norm_rel(a: Run, b: Run) -> float:
    num = sum(float(np.sum((a.grads[k].astype(np.float64) - b.grads[k]) ** 2)) for k in b.grads)
    den = sum(float(np.sum(b.grads[k].astype(np.float64) ** 2)) for k in b.grads)
    return (num / den) ** 0.5


def test_single_starts_from_the_shared_numpy_init_and_saves_hf_weights(runner):
    from safetensors.numpy import load_file

    from gpt2common.hf import load_hf, to_hf_state_dict
    from jaxpar.config import PRESETS
    from jaxpar.models.gpt2 import init_params

    s = runner("strategy=single")
    want = to_hf_state_dict(PRESETS["gpt2-tiny"], init_params(PRESETS["gpt2-tiny"], 0))
    got = load_file(os.path.join(s.out, "init", "model.safetensors"))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert s.psi == 4 * PRESETS["gpt2-tiny"].num_params() == 1_849_344
    mcfg, params = load_hf(os.path.join(s.out, "hf"))  # final weights, HF safetensors layout
    assert mcfg == PRESETS["gpt2-tiny"]
    assert not np.array_equal(params["wte"]["weight"], want["transformer.wte.weight"])
    assert s.losses[-1] < s.losses[0] - 0.5  # it learns: 5.50 -> 4.44 on the built-in corpus
    assert [r["step"] for r in s.rows] == list(range(1, STEPS + 1))
    assert all(r["bytes_sent"] == r["bytes_received"] == 0 for r in s.rows)


def test_single_equals_jaxpar(runner, jaxpar_ref):
    check_against_jaxpar(runner("strategy=single"), jaxpar_ref, "fp32")


SYNC = [("single-ps", 2), ("distributed-ps", 2), ("single-ps", 4), ("distributed-ps", 4)]
SYNC_MPI = [pytest.param("horovod", 2, ["horovod.algorithm=ring", "horovod.fusion_mb=0.25"], id="horovod-ring-2"),
            pytest.param("horovod", 4, ["horovod.algorithm=ring"], marks=pytest.mark.slow, id="horovod-ring-4"),
            pytest.param("horovod", 4, [], marks=pytest.mark.slow, id="horovod-mpi-4")]


@pytest.mark.parametrize("strategy, n, extra", [pytest.param(s, n, [], id=f"{s}-{n}") for s, n in SYNC] + SYNC_MPI)
def test_sync_fp32_strategy_equals_single(runner, jaxpar_ref, strategy, n, extra):
    if strategy == "horovod":
        require_mpiexec()
    single = runner("strategy=single")
    run = runner(f"strategy={strategy}", f"workers={n}", *extra)
    assert loss_rel(run, single) <= LOSS_RTOL_FP32
    assert grad_rel(run, single) <= GRAD_TOL_FP32
    check_against_jaxpar(run, jaxpar_ref, "fp32")
    psi = run.psi
    for r in run.rows:
        if strategy == "single-ps":
            # All traffic through the server: N*Psi in (grads) + N*Psi out (weights) per step.
            assert r["server_bytes_sent"] + r["server_bytes_received"] == 2 * psi * n
            assert r["server_bytes_received"] == r["server_bytes_sent"] == psi * n
            assert r["bytes_sent"] == r["bytes_received"] == psi
        else:
            # Ring all-reduce: 2(N-1)/N * Psi per worker (Psi = 1,849,344 B divides by 4 and by
            # every fusion buffer split, so the volume is exact).
            assert r["bytes_sent"] == r["bytes_received"] == 2 * (n - 1) * psi // n
    procs = run.summary["procs"]
    assert len(procs) == (n + 1 if strategy == "single-ps" else n)
    workers = [p for p in procs if p["role"] == "worker"]
    assert len(workers) == n
    per_worker = {2 * (n - 1) * psi // n * STEPS} if strategy != "single-ps" else {psi * STEPS}
    assert {p["bytes_sent"] for p in workers} == per_worker



@pytest.mark.parametrize("strategy, n, extra", [
    pytest.param("distributed-ps-amp", 2, [], id="ddp-amp-bf16-2"),
    pytest.param("distributed-ps-amp", 4, [], id="ddp-amp-bf16-4"),
    pytest.param("distributed-ps-amp", 2, ["amp.dtype=fp16"], id="ddp-amp-fp16-2"),
    # horovod-amp at 2 workers also runs (and is checked) in test_torchref_compare's example.
    pytest.param("horovod-amp", 2, [], id="horovod-amp-bf16-2"),
])
def test_amp_within_bf16_bound(runner, jaxpar_ref, strategy, n, extra):
    if strategy == "horovod-amp":
        require_mpiexec()
    single = runner("strategy=single")
    run = runner(f"strategy={strategy}", f"workers={n}", *extra)
    assert loss_rel(run, single) <= LOSS_RTOL_AMP
    assert grad_norm_rel(run, single) <= GRAD_NORM_RTOL_AMP
    assert grad_rel(run, single) > GRAD_TOL_FP32  # it really computed in reduced precision
    if "amp.dtype=fp16" not in extra:  # GradScaler skips overflowing steps: not step-for-step comparable
        check_against_jaxpar(run, jaxpar_ref, "bf16")
    if "amp.dtype=fp16" in extra:
        assert all(r["loss_scale"] >= 1.0 for r in run.rows)  # GradScaler's dynamic loss scale is live


def test_horovod_fp16_compression_halves_bytes(runner):
    require_mpiexec()
    single = runner("strategy=single")
    full = runner("strategy=horovod", "workers=2", "horovod.algorithm=ring", "horovod.fusion_mb=0.25")
    half = runner("strategy=horovod", "workers=2", "horovod.algorithm=ring", "horovod.fusion_mb=0.25",
                  "horovod.compression=fp16")
    for a, b in zip(half.rows, full.rows):
        assert 2 * a["bytes_sent"] == b["bytes_sent"] == single.psi
        assert 2 * a["bytes_received"] == b["bytes_received"]
    assert loss_rel(half, single) <= LOSS_RTOL_FP16_WIRE
    assert grad_rel(half, single) > GRAD_TOL_FP32  # the wire really was fp16
    # every row names the run's settings (what `compare` and a reader of metrics.jsonl go by)
    assert {(r["algorithm"], r["compression"], r["fusion_mb"]) for r in half.rows} == {("ring", "fp16", 0.25)}
    assert {(r["algorithm"], r["compression"], r["fusion_mb"]) for r in full.rows} == {("ring", "none", 0.25)}


def test_async_ps_runs_and_loss_decreases(runner):
    from torchref.config import resolve_ref
    from torchref.model import lr_at

    n, steps, stale = 2, 30, 1
    args = ("strategy=single-ps", f"workers={n}", "ps.async=true", f"ps.max_staleness={stale}",
            f"train.steps={steps}", "train.warmup_steps=0", "debug.grad_step=0")
    run = runner(*args)
    assert [r["step"] for r in run.rows] == list(range(1, steps + 1))
    assert all(r["ps_async"] is True and 0 <= r["staleness"] <= stale for r in run.rows)
    assert {r["worker"] for r in run.rows} == set(range(n))  # both workers' gradients were applied
    assert run.losses[-5:].mean() < run.losses[:5].mean() - 0.3
    assert all(r["server_bytes_sent"] == r["server_bytes_received"] == run.psi for r in run.rows)
    # Update k (row k) runs the schedule's step k-1, as the synchronous strategies do.
    t = resolve_ref(list(BASE) + list(args))[0].train
    assert [r["lr"] for r in run.rows] == [float(lr_at(t, k)) for k in range(steps)]
    # Every gradient a worker pushed was applied (one per step), dropped as too stale, or arrived
    # after the last step: exactly one per other worker, each still computing on weights it pulled
    # before the server reached train.steps; those late ones are not counted as dropped.
    procs = run.summary["procs"]
    server = [p for p in procs if p["role"] == "server"]
    pushes = sum(p["pushes"] for p in procs if p["role"] == "worker")
    assert len(server) == 1 and pushes == steps + server[0]["dropped"] + (n - 1)
    assert server[0]["bytes_received"] == pushes * run.psi


def test_dying_worker_stops_the_others_quickly(runner, tmp_path):
    from torchref.config import WorkerDied, resolve_ref
    from torchref.launch import train

    runner("strategy=single")  # make sure the module's data dir exists (and imports are warm)
    cfg, ref = resolve_ref(BASE + ["strategy=distributed-ps", "workers=2", "debug.crash_rank=1", "debug.crash_step=3",
                                   "timeout_s=60", f"out={tmp_path}/crash"])
    with pytest.raises(WorkerDied) as e:
        train(cfg, ref)
    # Timed from the crash, not from the start: set-up (weights, data, fork) under a loaded host
    # once pushed the whole call past the bound. The last metrics line (step 2) is written as
    # rank 1 reaches step 3 and dies, so its mtime marks the crash to within one tiny step.
    metrics = tmp_path / "crash" / "metrics.jsonl"
    elapsed = time.time() - metrics.stat().st_mtime
    assert str(e.value) == (f"strategy=distributed-ps: process rank 1 of 2 died (exit code 17); stopped the other 1 "
                            f"(logs in {tmp_path}/crash/logs)")
    assert elapsed < 20  # the launcher's watchdog, not the 60 s collective timeout
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_single_ps_crash_rank_counts_workers_not_the_server(runner, tmp_path):
    """debug.crash_rank=w names worker w (process rank w + 1: rank 0 is the server), as the other
    strategies' worker index does; it dies before its first gradient, so the run stops at once."""
    from torchref.config import WorkerDied, resolve_ref
    from torchref.launch import train

    runner("strategy=single")  # warm imports, as test_dying_worker_stops_the_others_quickly
    cfg, ref = resolve_ref(BASE + ["strategy=single-ps", "workers=2", "debug.crash_rank=1", "debug.crash_step=1",
                                   "timeout_s=60", f"out={tmp_path}/crash"])
    with pytest.raises(WorkerDied) as e:
        train(cfg, ref)
    assert str(e.value) == (f"strategy=single-ps: process rank 2 of 3 died (exit code 17); stopped the other 2 "
                            f"(logs in {tmp_path}/crash/logs)")


@pytest.mark.slow  # ~40 s: CLI + mpiexec imports; the watchdog path is covered by the test above
def test_dying_mpi_rank_cli_exits_2_one_line(runner, tmp_path):
    import subprocess
    import sys

    require_mpiexec()
    data = runner("strategy=single").out / "data"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torchref", "train", *BASE, "strategy=horovod", "workers=2",
                        "debug.crash_rank=0", "debug.crash_step=2", f"data={data}", f"out={tmp_path}/crash"],
                       capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: strategy=horovod: an MPI rank died (mpiexec exit code ")
    assert lines[0].endswith(f"unfinished ranks [0, 1]); mpiexec stopped the others (logs in {tmp_path}/crash/logs)")
    assert time.monotonic() - t0 < 240


def _from_hf_dir(runner) -> "Run":
    """A single run from the first one's final HF weights, on another batch order (seed=5), writing
    its training state every 4 steps: 4 does not divide train.steps=10, so the state after the
    last step is written by the "and after the last" rule alone."""
    return runner("strategy=single", f"init={runner('strategy=single').out}/hf", "seed=5", "state_every=4")


def test_init_from_hf_dir_starts_from_those_weights(runner):
    from safetensors.numpy import load_file

    first = runner("strategy=single")
    resumed = _from_hf_dir(runner)
    a = load_file(os.path.join(first.out, "hf", "model.safetensors"))
    b = load_file(os.path.join(resumed.out, "init", "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # Trained weights on a fresh batch order (seed=5) start well below the untrained 5.5.
    assert resumed.losses[0] < first.losses[0] - 0.5


def test_state_every_not_dividing_the_steps_still_writes_the_last_state(runner):
    """state_every=4 with train.steps=10: states after steps 4, 8 and the last, 10 (nothing
    else); the last is the run's final weights (hf/) with AdamW and schedule counts 10."""
    from gpt2common import state as fmt

    run = _from_hf_dir(runner)
    assert sorted(os.listdir(run.out / "state"), key=int) == ["4", "8", "10"]
    last = fmt.load_state(str(run.out / "state" / "10"), "init_state")
    opt = last.manifest["optimizer"]
    assert (last.step, opt["adam_count"], opt["schedule_count"]) == (10, 10, 10)
    from safetensors.numpy import load_file

    final = load_file(os.path.join(run.out, "hf", "model.safetensors"))
    assert all(np.array_equal(last.params[k], final[k]) for k in final) and len(final) == len(last.params)

def greedy_buckets(sizes: list[int], cap: int) -> list[int]:
    """DDP's documented bucketing, by hand: parameters in reverse registration order, a bucket
    closes once it holds >= cap bytes."""
    out, cur = [], 0
    for s in reversed(sizes):
        cur += s
        if cur >= cap:
            out.append(cur)
            cur = 0
    return out + ([cur] if cur else [])


def test_ddp_bucket_mb_sets_the_buckets_and_keeps_the_gradient(runner):
    """Reference: hand bucketing of gpt2-tiny's tensors (greedy_buckets; e.g. ln_f (1,024 B) + the
    last mlp.c_proj (262,656 B) = 263,680 B closes the first 0.25 MiB bucket), the ring volume
    2(N-1)/N·Ψ, and `single`'s step-1 gradient and losses (fp32 bounds of jaxpar/tolerances.py)."""
    import transformers

    from gpt2common.hf import hf_config_dict
    from jaxpar.config import PRESETS

    single = runner("strategy=single")
    small = runner("strategy=distributed-ps", "workers=2", "ddp.bucket_mb=0.25")
    default = runner("strategy=distributed-ps", "workers=2")  # ddp.bucket_mb=25 > Ψ: one bucket
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_dict(PRESETS["gpt2-tiny"])))
    sizes = [p.numel() * 4 for p in model.parameters()]
    psi = sum(sizes)
    assert psi == small.psi == 1_849_344
    want = greedy_buckets(sizes, int(0.25 * 2**20))
    assert want == [263_680, 264_192, 265_216, 263_680, 264_192, 265_216, 263_168]
    # step 1 runs DDP's initial buckets (measured: one of Ψ); from step 2 on, the rebuilt ones
    assert all(sum(r["ddp_bucket_bytes"]) == psi for r in small.rows)
    assert [r["ddp_bucket_bytes"] for r in small.rows[1:]] == [want] * (STEPS - 1)
    assert [r["ddp_bucket_bytes"] for r in default.rows] == [[psi]] * STEPS
    assert [r["bucket_mb"] for r in small.rows + default.rows] == [0.25] * STEPS + [25.0] * STEPS
    assert all(r["bytes_sent"] == r["bytes_received"] == 2 * (2 - 1) * psi // 2 for r in small.rows)
    assert loss_rel(small, single) <= LOSS_RTOL_FP32
    assert grad_rel(small, single) <= GRAD_TOL_FP32
