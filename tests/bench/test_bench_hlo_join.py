"""benchmarks/hlo_join.py: a profile's per-instruction times joined to the compiled HLO (bytes, GB/s,
source lines), on a hand-written module whose figures are worked out below, and on a CPU trace of
the real gpt2-tiny bf16 step (what gpu_profile.py does with the GPU's kernels)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_profile  # noqa: E402
import hlo_join  # noqa: E402

MODULE = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[8,128]{1,0}, bf16[128]{0})->f32[8,8]{1,0}}

FileNames
1 "/x/jaxpar/models/layernorm.py"
2 "/x/jaxpar/optim.py"

FunctionNames
1 "LayerNorm.__call__"
2 "make_update.<locals>.update.<locals>.leaf"

FileLocations
1 {file_name_id=1 function_name_id=1 line=30 end_line=30 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=88 end_line=88 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%fused_computation.1 (param_0.1: f32[8,128], param_1.2: bf16[128]) -> f32[8,128] {
  %param_0.1 = f32[8,128]{1,0} parameter(0)
  %param_1.2 = bf16[128]{0} parameter(1)
  %convert.3 = f32[128]{0} convert(%param_1.2), metadata={op_name="jit(f)/convert_element_type" stack_frame_id=1}
  %broadcast.4 = f32[8,128]{1,0} broadcast(%convert.3), dimensions={1}, metadata={op_name="jit(f)/add" stack_frame_id=1}
  ROOT %multiply.5 = f32[8,128]{1,0} multiply(%param_0.1, %broadcast.4), metadata={op_name="jit(f)/mul" stack_frame_id=2}
}

%copy_computation.2 (param_0.6: f32[8,8]) -> f32[8,8] {
  %param_0.6 = f32[8,8]{1,0} parameter(0)
  ROOT %copy.7 = f32[8,8]{0,1} copy(%param_0.6)
}

ENTRY %main.9 (Arg_0.1: f32[8,128], Arg_1.2: bf16[128]) -> f32[8,8] {
  %Arg_0.1 = f32[8,128]{1,0} parameter(0)
  %Arg_1.2 = bf16[128]{0} parameter(1)
  %loop_multiply_fusion.1 = f32[8,128]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/mul" stack_frame_id=2}
  %custom-call.7 = (f32[8,8]{1,0}, s8[256]{0}) custom-call(%loop_multiply_fusion.1, %loop_multiply_fusion.1), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
  %get-tuple-element.8 = f32[8,8]{1,0} get-tuple-element(%custom-call.7), index=0
  ROOT %copy_fusion.3 = f32[8,8]{0,1} fusion(%get-tuple-element.8), kind=kLoop, calls=%copy_computation.2
}
"""


def test_a_module_gives_each_instruction_its_bytes_opcodes_and_source_lines():
    m = hlo_join.parse_module(MODULE)
    assert sorted(m.computations) == ["copy_computation.2", "fused_computation.1", "main.9"]
    assert m.frames == {1: "layernorm.py:30 LayerNorm.__call__", 2: "optim.py:88 make_update.update.leaf"}
    fusion, gemm, copy = (m.instrs[n] for n in ("loop_multiply_fusion.1", "custom-call.7", "copy_fusion.3"))
    assert (fusion.opcode, fusion.operands, fusion.calls) == ("fusion", ["Arg_0.1", "Arg_1.2"], "fused_computation.1")
    assert gemm.operands == ["loop_multiply_fusion.1", "loop_multiply_fusion.1"]
    # out 8*128*4 = 4096, in 4096 + 128*2; the gemm: out (8*8*4 + 256 workspace), in 2 * 4096
    assert [hlo_join.traffic(m, i) for i in (fusion, gemm, copy)] == [4096 + 4096 + 256, 512 + 8192, 256 + 256]
    # a fusion's lines: the ops inside it, most common first; a copy whose ops carry none: its own (none)
    assert hlo_join.sources(m, fusion) == ["layernorm.py:30 LayerNorm.__call__", "optim.py:88 make_update.update.leaf"]
    assert hlo_join.sources(m, gemm) == ["optim.py:88 make_update.update.leaf"]
    assert hlo_join.sources(m, copy) == []
    assert hlo_join.fused_ops(m, fusion) == {"convert": 1, "broadcast": 1, "multiply": 1}


def test_join_charges_kernel_times_to_instructions_and_source_lines():
    m = hlo_join.parse_module(MODULE)
    # a kernel spelled with '_' for '.', a custom-call by its HLO name, a runtime event the module lacks
    rows = hlo_join.join({"loop_multiply_fusion_1": 0.001, "custom-call.7": 0.002, "memcpy": 0.5,
                          "copy_fusion.3": 0.0005}, m, hbm_tbps=1.0)
    assert [(r["key"], r["hlo"]) for r in rows] == [("memcpy", None), ("custom-call.7", "custom-call.7"),
                                                    ("loop_multiply_fusion_1", "loop_multiply_fusion.1"),
                                                    ("copy_fusion.3", "copy_fusion.3")]
    f = rows[2]
    assert (f["bytes"], f["shape"], f["op_name"]) == (8448, "f32[8,128]", "jit(f)/mul")
    assert f["gb_per_s"] == pytest.approx(8448 / 1e-6 / 1e9)
    assert f["hbm_share"] == pytest.approx(8.448 / 1000)
    assert hlo_join.by_source(rows) == pytest.approx({"unjoined": 0.5, "optim.py:88 make_update.update.leaf": 0.002,
                                                      "layernorm.py:30 LayerNorm.__call__": 0.001,
                                                      "no source": 0.0005})
    assert list(hlo_join.by_source(rows))[:2] == ["unjoined", "optim.py:88 make_update.update.leaf"]


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """(trace events of the compiled step, its HLO text): gpt2-tiny bf16, B2 T32, one traced step."""
    import jax
    from gpu_mfu import preset_step

    _, trainer, state, x, y = preset_step("gpt2-tiny", 2, 32)
    step = trainer.step_fn.lower(state, x, y).compile()  # one compile, as gpu_profile.py
    text = step.as_text()
    state, m = step(state, x, y)
    float(m["loss"])
    logdir = str(tmp_path_factory.mktemp("trace"))
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        state, m = step(state, x, y)
        float(m["loss"])
    events = gpu_profile.read_trace(logdir)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit_train_step"], text


def test_every_traced_instruction_of_the_real_step_joins_to_its_source(cpu_trace):
    events, text = cpu_trace
    assert len(events) > 100
    out = gpu_profile.joined(events, text, steps=1, hbm=None, top=10**6)
    assert out["unjoined_ms"] == 0.0
    assert sum(r["ms"] for r in out["rows"]) == pytest.approx(sum(e["dur"] for e in events) / 1e3)
    files = {src.split(":")[0] for src in out["by_source_ms"]}
    # the model's layers and norms, the loss and the optimizer each own some of the time
    assert {"gpt2.py", "layernorm.py", "precision.py", "optim.py"} <= files
    assert any(src.endswith("token_nll") for src in out["by_source_ms"])
    # a fusion is charged to the lines of the ops inside it (several), not to its own one frame
    assert any(len(r["sources"]) > 1 for r in out["rows"] if r["opcode"] == "fusion")
    dots = [r for r in out["rows"] if "dot" in r["opcode"] or "dot" in r.get("ops", {})]
    assert dots and all(r["bytes"] > 0 and r["sources"] for r in dots)


def test_gpu_profile_main_reports_the_join(monkeypatch, tmp_path, capsys):
    """gpu_profile.main end to end on CPU: the GPU check stood in, the CPU thunks standing for the
    stream's kernels; the report and the JSON carry the joined rows."""
    monkeypatch.setattr(gpu_profile, "start_gpu", lambda *a: True)
    monkeypatch.setattr(gpu_profile, "complete_events", lambda trace, threads, which: [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit_train_step"])
    out = tmp_path / "prof.json"
    assert gpu_profile.main(["--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--steps", "2",
                             "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["hbm_tbps"] is None and rep["hlo"]["unjoined_ms"] == 0.0 and len(rep["hlo"]["rows"]) == 40
    # busy: the union of the events' spans (CPU thunks overlap across threads), at most their sum
    assert 0 < rep["kernels"]["busy_ms"] <= sum(rep["kernels"]["by_class_ms"].values()) + 1e-9
    text = capsys.readouterr().out
    assert "ms/step not named by the step's HLO" in text and "  by source line:" in text
    assert sum(1 for line in text.splitlines() if "LayerNorm.__call__" in line) >= 1
