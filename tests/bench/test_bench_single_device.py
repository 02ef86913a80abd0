"""benchmarks/single_device.py runs end to end on a micro config and writes the JSON report.

No timing is asserted (the machine is shared); only the report's shape, that both frameworks
started from the same weights (same first loss), and that every ratio is a positive number.
"""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # the benchmark script end to end (20 s); its ratio and JSON logic run in -m slow
def test_single_device_benchmark_micro(tmp_path):
    out = tmp_path / "sd.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "single_device.py"), "--configs", "custom",
           "--n-layer", "1", "--n-embd", "32",
           "--n-head", "2", "--vocab", "64", "--seq", "16", "--batch", "2", "--impls", "jaxpar,torch_eager",
           "--precisions", "fp32,bf16", "--torch-bf16", "full", "--warmup", "0", "--rounds", "2", "--out", str(out),
           "--host-memory", "keep"]  # one process; `both` (two of them) is test_merge_runs below
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "jaxpar x" in proc.stdout
    top = json.loads(out.read_text())
    assert set(top) == {"env", "configs"} and set(top["configs"]) == {"custom"}
    env = top["env"]
    assert set(env) >= {"cpu_flags", "cpu_model", "loadavg_before", "loadavg_after", "torch_native_bf16"}
    assert env["cpu_model"] and env["cpu_model"] in open("/proc/cpuinfo").read()
    assert env["host_memory_kept"] is (sys.platform == "linux")  # glibc malloc keeps XLA:CPU temporaries mapped
    assert len(env["loadavg_before"]) == 3 and all(f in open("/proc/cpuinfo").read() for f in env["cpu_flags"])
    rep = top["configs"]["custom"]
    assert set(rep) >= {"config", "results", "ratios", "skipped"}
    assert rep["config"]["tokens_per_step"] == 32
    assert set(rep["results"]) == {"jaxpar/fp32", "torch_eager/fp32", "jaxpar/bf16", "torch_eager/bf16"}
    for r in rep["results"].values():
        assert len(r["times_s"]) == 2 and r["median_s"] > 0 and r["tokens_per_s"] > 0
        # per-step CPU time, not the process's running total. (Not bounded by wall x cores: the
        # kernel accounts other threads' CPU lazily, so a 2 ms window can show 4.7 ms.)
        assert len(r["cpu_s"]) == 2 and all(c > 0 for c in r["cpu_s"])
        assert r["cpu_median_s"] == statistics.median(r["cpu_s"])
        # --rounds 2 fits one turn of the default --block 3, led by its one --settle step
        assert len(r["settle_s"]) == 1 and r["settle_s"][0] > 0
        # the throughput figures are the median step's: B*T = 32 tokens, 6N + attention FLOPs per token
        assert r["median_s"] == statistics.median(r["times_s"]) and r["tokens_per_s"] == 32 / r["median_s"]
        assert r["gflops_per_s"] == rep["config"]["flops_per_token"] * 32 / r["median_s"] / 1e9
    assert (rep["config"]["block"], rep["config"]["settle"]) == (3, 1)
    # the steps' windows are disjoint, so their CPU times sum to at most the whole process's
    # (a running total would count the imports and compiles once per step)
    assert sum(sum(r["cpu_s"]) for r in rep["results"].values()) <= env["process_cpu_s"]
    assert set(rep["ratios"]) == {"fp32/vs_torch_eager", "bf16/vs_torch_eager", "bf16/vs_jaxpar_fp32"}
    assert all(math.isfinite(v) and v > 0 for v in rep["ratios"].values())
    # Same weights and batch on both sides: identical first loss in fp32 (~ln 64), close in bf16.
    res = rep["results"]
    assert abs(res["jaxpar/fp32"]["first_loss"] - res["torch_eager/fp32"]["first_loss"]) < 1e-4
    assert abs(res["jaxpar/bf16"]["first_loss"] - res["torch_eager/bf16"]["first_loss"]) < 5e-2
    assert abs(res["jaxpar/fp32"]["first_loss"] - math.log(64)) < 0.1


def test_merge_runs_takes_jaxpar_from_keep_and_each_torch_contender_from_its_faster_run():
    """`--host-memory both`: jaxpar's figure is the keep run's even where default was faster (it is
    what `jaxpar train` runs); each torch contender gets its faster run; ratios are recomputed."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import single_device as sd

    def run(medians, mode, load):
        res = {n: {"median_s": m, "times_s": [m]} for n, m in medians.items()}
        return {"env": {"host_memory": mode}, "configs": {"c": {"results": res, "ratios": {}, "loadavg_end": [load]}}}

    keep = run({"jaxpar/fp32": 1.0, "torch_eager/fp32": 0.8, "jaxpar/bf16": 0.5, "torch_eager/bf16": 1.5}, "keep", 1.0)
    default = run({"jaxpar/fp32": 0.9, "torch_eager/fp32": 0.9, "jaxpar/bf16": 0.6, "torch_eager/bf16": 0.75},
                  "default", 2.0)
    rep = sd.merge_runs(keep, default, ["fp32", "bf16"], ["jaxpar", "torch_eager"])["configs"]["c"]
    got = {n: (r["median_s"], r["host_memory"]) for n, r in rep["results"].items()}
    assert got == {"jaxpar/fp32": (1.0, "keep"), "torch_eager/fp32": (0.8, "keep"),
                   "jaxpar/bf16": (0.5, "keep"), "torch_eager/bf16": (0.75, "default")}
    assert rep["ratios"] == {"fp32/vs_torch_eager": 0.8, "bf16/vs_torch_eager": 1.5, "bf16/vs_jaxpar_fp32": 2.0}
    # both medians stay in the row, each under its own run's name, whichever was taken
    both = {n: (r["median_s_keep"], r["median_s_default"]) for n, r in rep["results"].items()}
    assert both == {"jaxpar/fp32": (1.0, 0.9), "torch_eager/fp32": (0.8, 0.9),
                    "jaxpar/bf16": (0.5, 0.6), "torch_eager/bf16": (1.5, 0.75)}
    assert rep["loadavg_end"] == [1.0] and rep["loadavg_end_default_run"] == [2.0]


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import single_device as sd
    return sd


@given(n=st.integers(1, 4), rounds=st.integers(1, 12), block=st.integers(1, 5), settle=st.integers(0, 2))
def test_schedule_times_each_contender_rounds_steps_in_turns_led_by_settle_steps(n, rounds, block, settle):
    names = [f"c{i}" for i in range(n)]
    order = _bench().schedule(names, rounds, block, settle)
    assert {c: sum(t for m, t in order if m == c) for c in names} == dict.fromkeys(names, rounds)
    # parse the order back into turns: `settle` untimed steps, then 1..block timed ones, one contender
    turns, i = [], 0
    while i < len(order):
        c = order[i][0]
        assert order[i:i + settle] == [(c, False)] * settle, (i, order)
        i += settle
        k = 0
        while i < len(order) and order[i] == (c, True) and k < block:
            i, k = i + 1, k + 1
        assert k >= 1, (i, order)
        turns.append((c, k))
    # full turns until a contender's last one; pass p starts at contender p mod n
    for c in names:
        ks = [k for m, k in turns if m == c]
        assert ks == [block] * (rounds // block) + ([rounds % block] if rounds % block else [])
    passes = -(-rounds // block)
    assert len(turns) == n * passes
    for p in range(passes):
        assert [m for m, _ in turns[p * n:(p + 1) * n]] == names[p % n:] + names[:p % n]


def test_schedule_block_1_settle_0_is_the_old_one_step_rotation():
    names = ["jaxpar/fp32", "torch_eager/fp32", "torch_compile/fp32"]
    old = [(m, True) for r in range(5) for m in names[r % 3:] + names[:r % 3]]
    assert _bench().schedule(names, 5, 1, 0) == old


@pytest.mark.parametrize("flags,line", [
    (["--block", "0"], "error: --block 0: must be >= 1"),
    (["--settle", "-1"], "error: --settle -1: must be >= 0"),
    (["--rounds", "0"], "error: --rounds 0: must be >= 1"),
    (["--impls", "jax,torch_eager"], "error: --impls jax: expected a comma list of jaxpar,torch_eager,torch_compile"),
    (["--precisions", "fp16"], "error: --precisions fp16: expected a comma list of fp32,bf16"),
    (["--configs", ","], "error: --configs (empty): expected a comma list of small,mid,gpt2,custom"),
])
def test_bad_flags_get_one_error_line_and_exit_2(tmp_path, flags, line):
    out = tmp_path / "sd.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "single_device.py"), *flags,
                           "--host-memory", "keep", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")
    assert not out.exists()
