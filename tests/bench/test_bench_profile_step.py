"""benchmarks/profile_step.py's thunk census on a hand-made trace: what counts as a thunk, per step and per thread."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import profile_step  # noqa: E402

A, B, C, PY = (1, 11), (1, 12), (1, 13), (1, 14)
NAMES = {A: "tf_XLAEigen/-618", B: "tf_XLAEigen/475", C: "tf_XLAPjRtCpuClient/-182", PY: "python"}


def ev(thread, name, dur):
    return {"pid": thread[0], "tid": thread[1], "name": name, "ts": 0, "dur": dur}


def two_steps():
    """Two steps of: a scan (while) of 2 ynn_fusion iterations on the pool threads, one dot run inline
    on the client thread, plus the runtime's spans, markers and pool records that are not thunks."""
    out = []
    for _ in range(2):
        out += [ev(C, "ThunkExecutor::Execute (wait for completion)", 900), ev(A, "ThunkExecutor::Execute", 500),
                ev(A, "while.45", 400), ev(A, "ynn_fusion.3", 100), ev(B, "ynn_fusion.3", 120),
                ev(A, "end: ynn_fusion.3", 0), ev(B, "SlinkyThreadPool::Await", 50),
                ev(A, "ThreadpoolListener::StartRegion", 0), ev(A, "ThreadpoolListener::StartRegion", 0),
                ev(B, "ThreadpoolListener::StopRegion", 0), ev(A, "ThreadpoolListener::Record", 0),
                ev(C, "dot.81", 60), ev(PY, "PjitFunction(jit(train_step))", 300)]
    return out


def test_census_counts_hlo_thunks_only():
    r = profile_step.census(two_steps(), NAMES, n_steps=2)
    assert r["thunks_per_step"] == 3  # ynn_fusion.3 twice (scan iterations) + dot.81
    assert r["thunk_ms_per_step"] == (100 + 120 + 60) / 1e3
    assert r["while_thunks_per_step"] == 1
    assert r["pool_tasks_per_step"] == 2
    assert r["threads"] == [{"thread": "tf_XLAEigen", "thunks_per_step": 1, "ms_per_step": 0.12},
                            {"thread": "tf_XLAEigen", "thunks_per_step": 1, "ms_per_step": 0.1},
                            {"thread": "tf_XLAPjRtCpuClient", "thunks_per_step": 1, "ms_per_step": 0.06}]
    kinds = {k["kind"]: (k["per_step"], k["ms_per_step"]) for k in r["kinds"]}
    assert kinds == {"ynn_fusion": (2, 0.22), "dot": (1, 0.06)}
    assert r["kinds"][0]["share"] == 220 / 280
    assert [t["name"] for t in r["top"]] == ["ynn_fusion.3", "dot.81"]


def test_hlo_line_finds_the_instruction_without_metadata():
    hlo = ("  %dot.8 = f32[2]{0} dot(%a, %b), lhs_contracting_dims={1}\n"
           "  ROOT %dot.81 = f32[128,512]{1,0} dot(%p, %q), lhs_contracting_dims={0}, metadata={op_name=\"x\"}\n")
    assert profile_step.hlo_line(hlo, "dot.81") == "f32[128,512]{1,0} dot(%p, %q), lhs_contracting_dims={0}"
    assert profile_step.hlo_line(hlo, "dot.9") == ""
