"""Collective bytes per step, from the compiled HLO, against the textbook theory
(`jaxpar.run.inspection.theory_bytes`), on 8 emulated devices. Compile only, nothing runs.

* data=8: every fp32 gradient reduced once, 2(N-1)/N·Ψ·4 per device. The tied wte (V, D)
  gradient reduced once per use (lookup and head, the old behaviour) gives 1.24x here, so the
  vocab is 1024 (wte is 23% of Ψ) to make that visible.
* fsdp=8 and (slow) data=2 x fsdp=2 x tensor=2: ZeRO-3 (jaxpar.parallel.fsdp) gathers each layer in
  forward and again in backward and reduce-scatters its gradient, wte/wpe/ln_f gathered once.
  The old auto-sharded step all-reduced the full gradient over fsdp and sliced it (XLA:CPU
  has no ReduceScatterCreator): 1.23x on GPT-2 124M; a per-use wte reduction or an all-reduce
  in place of a reduce-scatter shows here as a ratio above 1.05 or reduce-scatter bytes below
  the gradient's.
* data=4 x pipe=2 (GPipe, 2 microbatches): one (b, T, D) ppermute per schedule iteration each
  way, the stage's layers reduced over data, wte/wpe/ln_f over data·pipe with the tied wte
  reduced once (per use it was 1.24x here).
seq_len = n_positions, so the whole wpe table gets a gradient and Ψ counts only reduced
parameters. All configurations compile in one subprocess (the device count must be set before
JAX initialises).
"""

import pytest
from support.cli_helpers import run_probe

PSI = 536_064  # gpt2-tiny params with V=1024, P=64 (D=128, L=2)
OUTER = 1024 * 128 + 64 * 128 + 2 * 128  # wte, wpe, ln_f
NO_EMBED = 2 * (3 * 128 + 512)  # c_attn.bias (L, 3, N, Hd) and c_fc.bias (L, F): no embed dim, not fsdp-sharded
MESHES = {"data=8": {"data": 8}, "fsdp=8": {"fsdp": 8}, "data=4,pipe=2": {"data": 4, "pipe": 2, "microbatches": 2}}
MESHES_SLOW = {"data=2,fsdp=2,tensor=2": {"data": 2, "fsdp": 2, "tensor": 2}}

_PROBE = """
import dataclasses, json, sys
from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig
from jaxpar.run.inspection import COLLECTIVES, collective_bytes, compile_step, theory_bytes
m = dataclasses.replace(PRESETS["gpt2-tiny"], vocab_size=1024, n_positions=64)
out = {}
for name, sizes in json.loads(sys.argv[1]).items():
    pc = PipelineConfig(microbatches=sizes.pop("microbatches", 1))
    cfg = Config(model=m, mesh=MeshConfig(**sizes), precision="fp32", train=TrainConfig(batch_size=16, seq_len=64),
                 pipeline=pc)
    compiled, trainer = compile_step(cfg)
    coll = collective_bytes(compiled.as_text())
    out[name] = {"measured": coll["total_wire_bytes"], "theory": theory_bytes(trainer.cfg),
                 "kinds": {k: coll[k]["wire_bytes"] for k in COLLECTIVES}}
print(json.dumps(out))
"""


def _probe(meshes: dict) -> dict:
    return run_probe(_PROBE, meshes, devices=8)


@pytest.fixture(scope="module")
def bytes_per_mesh():
    return _probe(MESHES)


def test_data_parallel_bytes_per_step_match_ring_theory(bytes_per_mesh):
    r = bytes_per_mesh["data=8"]
    # theory: 2·7/8·Ψ·4 bytes
    assert r["theory"]["total"] == 2 * 7 / 8 * PSI * 4
    ratio = r["measured"] / r["theory"]["total"]
    # at most 5% over (the loss and grad-norm scalars, nothing else); below 0.99 would mean
    # some gradient is not reduced at all
    assert 0.99 <= ratio <= 1.05, ratio
    k = r["kinds"]
    assert k["all-gather"] == k["reduce-scatter"] == k["all-to-all"] == 0.0  # data parallel: all-reduce only


def test_zero3_reduce_scatters_its_gradient(bytes_per_mesh):
    r = bytes_per_mesh["fsdp=8"]
    # theory: 7/8·4·(3·Ψ_blocks + 2·Ψ_outer) bytes
    assert r["theory"]["total"] == r["theory"]["fsdp"] == 7 / 8 * 4 * (3 * (PSI - OUTER) + 2 * OUTER)
    assert 0.95 <= r["measured"] / r["theory"]["total"] <= 1.05, r
    k = r["kinds"]
    # every fsdp-sharded gradient reduce-scattered once: 7/8·4 bytes per element; the two biases
    # with no embed dim are all-reduced (2·7/8·4), with the loss/grad-norm scalars (< 400 bytes)
    assert k["reduce-scatter"] == 7 / 8 * (PSI - NO_EMBED) * 4, k
    assert 0 <= k["all-reduce"] - 2 * 7 / 8 * NO_EMBED * 4 < 400, k
    # the weights gathered 3x (blocks, forward + backward) or 2x (wte, wpe, ln_f: forward only)
    assert k["all-gather"] == pytest.approx(7 / 8 * 4 * (2 * (PSI - OUTER) + OUTER), rel=2e-2), k


@pytest.mark.slow
def test_zero3_with_data_and_tensor_matches_theory():
    r = _probe(MESHES_SLOW)["data=2,fsdp=2,tensor=2"]
    th = r["theory"]
    assert th["total"] == th["dp"] + th["fsdp"] + th["tp"] and th["pipe"] == 0
    assert 0.95 <= r["measured"] / th["total"] <= 1.05, r
    # the fsdp reduce-scatter moves Ψ_t/2 per device (1/2 · Ψ_t · 4 bytes, Ψ_t = Ψ after the tensor
    # split), not the whole of Ψ: the gather stays inside the tensor shard
    psi_t = r["theory"]["params_per_tensor_shard"]
    assert r["kinds"]["reduce-scatter"] == pytest.approx(1 / 2 * psi_t * 4, rel=1e-2), r["kinds"]


def test_pipeline_bytes_match_theory(bytes_per_mesh):
    r = bytes_per_mesh["data=4,pipe=2"]
    th = r["theory"]
    # stage loop: N = M + S - 1 = 3 iterations, each one (b=2, T=64, D=128) fp32 ppermute forward and
    # one backward; nothing else is a collective-permute
    assert r["kinds"]["collective-permute"] == th["pipe"] - 2 * 3 * (1 / 2) * 4 * 64 * 128 * 4 == 2 * 3 * 2 * 64 * 128 * 4
    # dp: the stage's layers over data (4), wte/wpe/ln_f over data·pipe (8)
    assert th["dp"] == 2 * 3 / 4 * (PSI - OUTER) / 2 * 4 + 2 * 7 / 8 * OUTER * 4
    assert 0.95 <= r["measured"] / th["total"] <= 1.05, r


@pytest.mark.parametrize("precision,act", [("bf16", 2), ("fp32", 4)])
def test_theory_counts_activations_in_the_compute_dtype(precision, act):
    """The activation terms (tensor all-reduces, pipeline permutes) move the compute dtype: 2 bytes
    per element under bf16, 4 under fp32 (the pipeline's ends stay fp32, 4 bytes). Closed forms for
    gpt2-tiny (L=2, D=128), batch 16 x 64. No compile."""
    from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig
    from jaxpar.run.inspection import theory_bytes

    tc = TrainConfig(batch_size=16, seq_len=64)
    tp = theory_bytes(Config(model=PRESETS["gpt2-tiny"], mesh=MeshConfig(tensor=2), precision=precision, train=tc))
    # 2(t-1)/t · (4L + 2) · b·s·h · bytes, b = 16 rows (one data replica, one microbatch)
    assert tp["tp"] == 2 * (1 / 2) * (4 * 2 + 2) * 16 * 64 * 128 * act
    pp = theory_bytes(Config(model=PRESETS["gpt2-tiny"], mesh=MeshConfig(data=4, pipe=2), precision=precision,
                             train=tc, pipeline=PipelineConfig(microbatches=2)))
    # N = M + S - 1 = 3 iterations of one (b=2, 64, 128) permute each way + the fp32 ends of 4 rows
    assert pp["pipe"] == 2 * 3 * 2 * 64 * 128 * act + 2 * 3 * (1 / 2) * 4 * 64 * 128 * 4


_ONE_ALL_REDUCE = """HloModule m, num_partitions=8

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups=GROUPS, use_global_device_ids=true, to_apply=%add
}
"""


@pytest.mark.parametrize("groups,n", [
    ("[2,4]<=[8]", 4),  # iota: 2 groups of 4
    ("[4,2]<=[2,4]T(1,0)", 2),  # iota, transposed: 4 groups of 2
    ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 2),
    ("{}", 8),  # every device
])
def test_group_size_in_each_of_xlas_replica_groups_spellings(groups, n):
    """One all-reduce of f32[1024] (4096 bytes) in a hand-written module: its group size read from
    each spelling XLA prints (the compiled steps above happen to print few of them), and the ring's
    2(n-1)/n · 4096 bytes per device."""
    from jaxpar.run.inspection import collective_bytes

    c = collective_bytes(_ONE_ALL_REDUCE.replace("GROUPS", groups))
    assert c["ops"][0]["group"] == n
    assert c["all-reduce"]["wire_bytes"] == c["total_wire_bytes"] == 2 * (n - 1) / n * 4096


def test_inspect_prints_the_layouts_warnings_on_stderr(monkeypatch, capsys):
    """`jaxpar inspect` prints the layout's warnings (e.g. a dominant bubble) on stderr, as `jaxpar
    train` does; stdout holds the report and, last, its JSON line. The compile is stood in for."""
    import jaxpar.run.inspection as I

    info = {"mesh": {"pipe": 2}, "warnings": ["warning: the bubble will dominate"], "ops": [], "ratio": 1.0}
    monkeypatch.setattr(I, "inspect_step", lambda cfg: info)
    monkeypatch.setattr(I, "format_report", lambda cfg, i: "REPORT")
    assert I.run_inspect(None) == 0
    assert capsys.readouterr() == ('REPORT\n{"mesh":{"pipe":2},"ratio":1.0}\n', "warning: the bubble will dominate\n")


@pytest.mark.parametrize("accum,schedule,ticks,ends", [
    (2, "gpipe", 3, True),  # N = M + S - 1; the ends move the rows of one microstep, A times
    (1, "1f1b", 4, False),  # N = M + 2S - 2 ticks, token ids go in: no ends
    (2, "1f1b", 4, False),
    (1, "zb", 4, False),  # ZB-H1 packs into as many ticks as 1f1b
])
def test_theory_pipeline_terms_per_microstep(accum, schedule, ticks, ends):
    """The pipeline theory with train.grad_accum=A and each schedule, closed forms for gpt2-tiny
    (D=128) on data=4 x pipe=2, M=2, batch 16·A x 64, fp32: each microstep moves N permutes each way of one
    (b=2, 64, 128) microbatch, plus (GPipe) the ends of its 16/4 = 4 rows per data replica. No compile."""
    from jaxpar.config import PRESETS, Config, MeshConfig, PipelineConfig, TrainConfig
    from jaxpar.run.inspection import theory_bytes

    th = theory_bytes(Config(model=PRESETS["gpt2-tiny"], mesh=MeshConfig(data=4, pipe=2), precision="fp32",
                             train=TrainConfig(batch_size=16 * accum, seq_len=64, grad_accum=accum),
                             pipeline=PipelineConfig(microbatches=2, schedule=schedule)))
    assert th["pipe"] == accum * (2 * ticks * 2 * 64 * 128 * 4 + ends * 2 * 3 * (1 / 2) * 4 * 64 * 128 * 4)


_LOOP = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add
}

%cond (q: f32[1024]) -> pred[] {
  %q = f32[1024]{0} parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %w = f32[1024]{0} while(%x), condition=%cond, body=%body TRIP
}
"""


@pytest.mark.parametrize("trip,times,unknown", [
    (', backend_config={"known_trip_count":{"n":"3"}}', 3, 0),
    ("", 1, 1),  # counted once and reported as such: the report's note says the bytes are a lower bound
])
def test_loop_bodies_count_their_trips_and_unknown_trips_are_reported(trip, times, unknown):
    """An all-reduce of f32[1024] over all 8 devices in a while body: 2·7/8·4096 bytes per trip."""
    from jaxpar.run.inspection import collective_bytes

    c = collective_bytes(_LOOP.replace(" TRIP", trip))
    assert (c["ops"][0]["times"], c["unknown_trip_counts"]) == (times, unknown)
    assert c["all-reduce"]["wire_bytes"] == times * 2 * 7 / 8 * 4096
