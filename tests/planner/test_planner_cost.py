"""Planner cost model: exact formulas (collectives, parameter counts, activations, bubble, MFU)."""

import pytest

from jaxpar.config import PRESETS, ConfigError, ModelConfig
from jaxpar.planner.cost import (
    GROUPS,
    Strategy,
    Workload,
    all_gather,
    all_reduce,
    axis_bandwidths,
    causal_blocks,
    estimate,
    group_elems,
    layer_activation_bytes,
    ppermute,
)
from jaxpar.planner.devices import GiB, get_device, parse_bytes

XL = PRESETS["gpt2-xl"]
H100 = get_device("h100")


def test_collective_formulas():
    # ring all-reduce: 2(n-1)/n · X bytes, 2(n-1) latency hops
    assert all_reduce(4, 1000.0, 0.0, 1.0) == (1500.0, 1500.0)
    t, b = all_gather(4, 1000.0, 1e-6, 1e3)
    assert b == 750.0 and t == pytest.approx(3e-6 + 0.75)
    assert ppermute(100.0, 1e-5, 1e2) == (pytest.approx(1.00001), 100.0)
    assert all_reduce(1, 1e9, 1.0, 1.0) == (0.0, 0.0)


def test_group_elements_sum_to_param_count():
    for name in ("gpt2-tiny", "gpt2", "gpt2-xl"):
        m = PRESETS[name]
        el = group_elems(m, 1, 1, {g: False for g in GROUPS})
        assert el["embed"] + m.n_layer * (el["attn"] + el["mlp"]) == m.num_params()
    # ZeRO-3 over f=8 shards everything but the biases without an embed dim (c_attn 3D, c_fc 4D)
    m, f = XL, 8
    el = group_elems(m, 1, f, {g: True for g in GROUPS})
    per_dev = el["embed"] + m.n_layer * (el["attn"] + el["mlp"])
    unsharded = m.n_layer * 7 * m.n_embd
    assert per_dev == pytest.approx((m.num_params() - unsharded) / f + unsharded)


def test_layer_activations_formula():
    w = Workload(XL, 8, 1024)  # bf16
    T, b, D, N = 1024, 1, 1600, 25
    sbh = T * b * D
    saved, live = layer_activation_bytes(w, b, 1, "none", 1)
    # 16 compute-dtype (b, T, D)-sized residuals (ln_1/ln_2 in and out, q,k,v,o, c_fc out and GELU
    # out, 2 x 4D), 4 fp32 LayerNorm stats per token; fp32 probs + their bf16 copy (GPU, T² per head)
    assert saved == live == sbh * 2 * 16 + 16 * T * b + (4 + 2) * N * T * T * b
    assert layer_activation_bytes(w, b, 1, "selective", 1)[0] == 32 * sbh + 16 * T * b
    assert layer_activation_bytes(w, b, 1, "full", 1)[0] == 2 * sbh
    # XLA:CPU's attention core saves the fp32 probs only
    assert layer_activation_bytes(w, b, 1, "none", 1, probs_copy=False)[0] == 32 * sbh + 16 * T * b + 4 * N * T * T * b
    # tensor=4 splits q,k,v,o + MLP units and the T² term; chunked MLP drops the MLP units
    assert layer_activation_bytes(w, b, 4, "none", 4)[0] == sbh * 2 * (4 + 4 / 4) + 16 * T * b + 6 * N * T * T * b / 4
    flash = Workload(XL, 8, 1024, attention="flash")
    assert layer_activation_bytes(flash, b, 1, "none", 1)[0] == 32 * sbh + 16 * T * b + 8 * N * T * b
    fp32 = Workload(XL, 8, 1024, precision="fp32")
    assert layer_activation_bytes(fp32, b, 1, "none", 1)[0] == 64 * sbh + 16 * T * b + 4 * N * T * T * b


def _scan_residuals(capsys, mc, policy, remat, b, t, mlp_chunks=1):
    """(activation bytes, weight-cast bytes) per layer of what the real model's layer scan saves:
    the (L, ...) 'output of scan' residuals of jax.ad_checkpoint.print_saved_residuals."""
    import math
    import re

    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

    from jaxpar.models import gpt2

    params = jax.tree.map(jnp.asarray, gpt2.init_params(mc, 0))
    tok = jnp.zeros((b, t + 1), jnp.int32)
    print_saved_residuals(
        lambda p: gpt2.GPT2(mc, p, policy=policy, remat=remat, mlp_chunks=mlp_chunks).loss(tok[:, :-1],
                                                                                         tok[:, 1:]), params)
    size = {"f32": 4, "bf16": 2}
    acts = weights = 0
    for line in capsys.readouterr().out.splitlines():
        got = re.match(rf"(\w+)\[{mc.n_layer},([\d,]+)\] output of scan", line)
        if got:
            dims = [int(x) for x in got.group(2).split(",")]
            n = size[got.group(1)] * math.prod(dims)  # one layer: the leading L dim is dropped
            if dims[0] == b:  # activations are (b, ...); weights (D, ...), (N, Hd, D), (4D, D)
                acts += n
            else:
                weights += n
    return acts, weights


@pytest.mark.parametrize("T", [8, 256])
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-einsum"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_layer_activations_match_the_census(capsys, monkeypatch, gpu, precision, remat, T):
    """layer_activation_bytes == the bytes the real model's layer scan saves per layer, for a tiny
    config: on CPU (jaxpar.models.mixed_attention's core) and on the GPU path (matmuls with compute-dtype
    outputs, the einsum core + jaxpar.models.softmax: emulated here by turning off CPU's fp32-output
    dots), where bf16 also saves each layer's bf16 weight casts (12·D² elements, the term
    `estimate` adds as 'saved compute-dtype weight casts'). B = 3 differs from every weight dim.
    T = 256: the CPU core keeps the probs of its 4 causal query blocks only (5/8 of (T, T))."""
    if gpu:
        from jaxpar.models import precision as prec

        monkeypatch.setattr(prec, "_fp32_out_dots", lambda: False)
    L, B, D, N = 2, 3, 16, 2
    mc = ModelConfig(n_layer=L, n_embd=D, n_head=N, vocab_size=64, n_positions=max(T, 16))
    w = Workload(mc, B, T, precision)
    acts, weights = _scan_residuals(capsys, mc, precision, remat, B, T)
    blocks = 1 if gpu else causal_blocks(T)
    assert blocks == (4 if T == 256 and not gpu else 1)
    saved, _ = layer_activation_bytes(w, B, 1, remat, 1, w.cb, probs_copy=gpu and w.cb < 4, blocks=blocks)
    assert acts == saved, (acts, saved)
    cast = gpu and precision == "bf16" and remat != "full"
    assert weights == (12 * D * D * w.cb if cast else 0)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-einsum"])
@pytest.mark.parametrize("precision,remat", [("bf16", "none"), ("bf16", "selective"), ("fp32", "none")])
def test_chunked_mlp_activations_match_the_census(capsys, monkeypatch, gpu, precision, remat):
    """mlp_chunks > 1: the layer keeps no MLP units; in bf16 the chunk loop's hand-written backward
    (jaxpar.models.chunked._chunk_scan_fp32_dx, fp32 input-gradient sum) saves x in bf16 as autodiff did."""
    if gpu:
        from jaxpar.models import precision as prec

        monkeypatch.setattr(prec, "_fp32_out_dots", lambda: False)
    L, B, D, N, T = 2, 3, 16, 2, 8
    mc = ModelConfig(n_layer=L, n_embd=D, n_head=N, vocab_size=64, n_positions=16)
    w = Workload(mc, B, T, precision)
    acts, _ = _scan_residuals(capsys, mc, precision, remat, B, T, mlp_chunks=2)
    saved, _ = layer_activation_bytes(w, B, 1, remat, 2, w.cb, probs_copy=gpu and w.cb < 4)
    assert acts == saved, (acts, saved)
    plain, _ = layer_activation_bytes(w, B, 1, remat, 1, w.cb, probs_copy=gpu and w.cb < 4)
    assert plain - saved == T * B * 4 * D * 2 * w.cb  # the (b, T, 4D) c_fc and GELU outputs


def test_flops_per_token_palm_formula():
    # GPT-2 small: N = 124,439,808 (HF count) - 786,432 (wpe) ; 6N + 12·L·D·T.
    # ModelConfig.flops_per_token: the one formula behind train's MFU and the planner's.
    assert PRESETS["gpt2"].num_params() == 124_439_808
    assert PRESETS["gpt2"].flops_per_token(1024) == 6 * (124_439_808 - 786_432) + 12 * 12 * 768 * 1024


def test_state_memory_and_mfu_identities():
    w = Workload(XL, 512, 1024)
    s = Strategy(data=8, fsdp=8, remat="selective")
    e = estimate(w, s, H100)
    el = group_elems(XL, 1, 8, {g: True for g in GROUPS})
    n_el = el["embed"] + XL.n_layer * (el["attn"] + el["mlp"])
    assert e.memory["params"] == 4 * n_el and e.memory["optimizer"] == 8 * n_el and e.memory["grads"] == 4 * n_el
    assert e.memory["total"] == pytest.approx(sum(v for k, v in e.memory.items() if k != "total"))
    assert e.mfu == pytest.approx(XL.flops_per_token(1024) * 512 * 1024 / (e.step_time_s * 64 * H100.peak_flops))
    assert e.tokens_per_s == pytest.approx(512 * 1024 / e.step_time_s)
    # grad accumulation adds an fp32 accumulator
    e2 = estimate(w, Strategy(data=8, fsdp=8, microbatches=2, remat="selective"), H100)
    assert e2.memory["grads"] == 8 * n_el



def test_a_plan_that_needs_exactly_the_memory_limit_fits():
    """`memory_limit` is what a device holds: a plan needing exactly that many bytes fits, one
    byte less of limit does not. Reference: the estimate's own memory total."""
    w, s = Workload(XL, 512, 1024), Strategy(data=8, fsdp=8, remat="selective")
    need = estimate(w, s, H100).memory["total"]
    assert estimate(w, s, H100, memory_limit=need).fits is True
    assert estimate(w, s, H100, memory_limit=need - 1).fits is False
    assert estimate(w, s, H100).fits is True  # no limit

def test_bubble_and_pipeline_split():
    w = Workload(XL, 64, 1024)
    e = estimate(w, Strategy(data=2, pipe=4, microbatches=8), H100)
    assert e.bubble == pytest.approx(3 / 11)
    # pipeline.py runs embedding and head outside the stages: equal stages
    assert e.layers_per_stage == (12, 12, 12, 12)
    e2 = estimate(w, Strategy(data=2, pipe=4, microbatches=8, repeats=2), H100)
    assert e2.bubble == pytest.approx(3 / 19)
    assert e2.layers_per_stage == (6,) * 8


def test_remat_and_splitting_trade_time_for_memory():
    w = Workload(XL, 64, 1024)
    base = estimate(w, Strategy(data=8), H100)
    full = estimate(w, Strategy(data=8, remat="full"), H100)
    assert full.step_time_s > base.step_time_s and full.memory["total"] < base.memory["total"]
    vc = estimate(w, Strategy(data=8, vocab_chunks=8), H100)
    b = 64 / 8
    # head temporaries: 2 fp32 (T, b, V) arrays (saved log-probs, logits grad), divided by the chunks
    assert base.memory["temporaries"] - vc.memory["temporaries"] == pytest.approx(
        2 * 1024 * b * XL.vocab_size * 4 * (1 - 1 / 8))
    assert vc.step_time_s > base.step_time_s


def test_axis_bandwidth_node_placement():
    # tensor innermost: tensor=8 stays in a node, with or without a pipeline around it; the pipe
    # (and data) axis outside it crosses nodes
    assert axis_bandwidths(H100, Strategy(data=2, tensor=8))["tensor"] == H100.bandwidth
    bw = axis_bandwidths(H100, Strategy(tensor=8, pipe=2))
    assert (bw["tensor"], bw["pipe"]) == (H100.bandwidth, H100.inter_bandwidth)
    bw = axis_bandwidths(H100, Strategy(tensor=2, pipe=4))  # 8 devices: all in one node
    assert (bw["tensor"], bw["pipe"]) == (H100.bandwidth, H100.bandwidth)
    assert axis_bandwidths(H100, Strategy(data=16))["data"] == H100.inter_bandwidth


def test_device_table_and_overrides():
    assert parse_bytes("16GB") == 16e9 and parse_bytes("16GiB") == 16 * GiB and parse_bytes("1.5e9") == 1.5e9
    with pytest.raises(ConfigError) as e:
        parse_bytes("lots")
    assert str(e.value) == "memory_limit='lots' is not a size (e.g. 16GB, 40GiB, 1.6e10)"
    d = get_device("h100", {"memory": "40GB", "peak_flops": "5e14"})
    assert d.memory == 40e9 and d.peak_flops == 5e14 and d.bandwidth == H100.bandwidth
    assert get_device("h200").memory == 141e9 and get_device("a100-40g").memory == 40 * GiB
    with pytest.raises(ConfigError) as e:
        get_device("tpu")
    assert str(e.value) == "device='tpu' is not known (choose from cpu, a100-40g, a100-80g, h100, h200)"
    with pytest.raises(ConfigError, match=r"^unknown key 'device.speed' \(valid: device.peak_flops, "):
        get_device("h100", {"speed": "1"})
    with pytest.raises(ConfigError, match=r"^device.efficiency='2' must be in \[0, 1\]$"):
        get_device("h100", {"efficiency": "2"})
    with pytest.raises(ConfigError, match=r"^device.overlap='2' must be in \[0, 1\]$"):  # hidden > the collective
        get_device("h100", {"overlap": "2"})


def test_tensor_parallel_divides_layer_state_and_adds_allreduces():
    m = ModelConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)
    w = Workload(m, 16, 1024)
    e1 = estimate(w, Strategy(data=2), H100)
    e4 = estimate(w, Strategy(data=2, tensor=4), H100)
    assert e4.comm_bytes["all-reduce"] > e1.comm_bytes["all-reduce"]
    # tensor: (4 per layer × 4 layers + 2 for embed/head) ring all-reduces of T·b·D·cb bytes over 4;
    # data: one all-reduce over 2 of the fp32 grads (per-tensor-shard elements), ring factor 2·1/2;
    # the tied wte once (lookup and logits grads summed before the reduction: jaxpar.parallel.tied).
    b = 16 / 2
    tensor_ar = (4 * 4 + 2) * 2 * 3 / 4 * 1024 * b * 1024 * 2
    el = group_elems(m, 4, 1, {g: False for g in GROUPS})
    grads_ar = 4 * (el["embed"] + 4 * (el["attn"] + el["mlp"]))
    assert e4.comm_bytes["all-reduce"] == pytest.approx(tensor_ar + grads_ar)


def test_vocab_chunks_reduce_the_wte_logits_grad_once_per_chunk():
    # chunked_cross_entropy closes over the tied wte inside its scan, so XLA all-reduces the
    # logits part of the wte grad (V·D fp32) once per chunk -- except where the step sums every
    # chunk's and the lookup's grads before one reduction (plain data parallelism, ZeRO-3)
    # (jaxpar.parallel.tied; compiled: 987,399 all-reduce bytes with vc = 1 and with vc = 8)
    m = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)
    w, cpu = Workload(m, 16, 128, "fp32"), get_device("cpu")
    base = estimate(w, Strategy(data=8), cpu).comm_bytes["all-reduce"]
    vc8 = estimate(w, Strategy(data=8, vocab_chunks=8), cpu).comm_bytes["all-reduce"]
    assert vc8 == base
    # ZeRO-3 (d=2, f=4) runs in a shard_map (jaxpar.parallel.fsdp): wte gathered once before the
    # chunks, their grads summed locally before one reduce-scatter (compiled, gpt2-tiny V1024 d=2
    # f=4: the same all-reduce, all-gather and reduce-scatter bytes with vc = 1 and with vc = 8)
    s1, s8 = Strategy(data=2, fsdp=4), Strategy(data=2, fsdp=4, vocab_chunks=8)
    e1, e8 = estimate(w, s1, cpu).comm_bytes, estimate(w, s8, cpu).comm_bytes
    assert {k: e8[k] for k in ("all-reduce", "all-gather", "reduce-scatter")} == \
        {k: e1[k] for k in ("all-reduce", "all-gather", "reduce-scatter")}
    assert e1["reduce-scatter"] > 0 and e1["all-gather"] > 0


def test_hlo_group_size_reads_mesh_groups_with_device_order():
    from jaxpar.run.inspection import _group_size

    ag = "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={1}"
    assert _group_size(ag, 8) == 4
    assert _group_size("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, to_apply=%add", 8) == 8
    assert _group_size("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == 2
    assert _group_size("replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add", 8) == 4


def test_elementwise_traffic_term_and_shared_host():
    """cpu row: residual stacking (STACK_PASSES × saved bytes per layer run) at mem_bandwidth,
    split between the devices sharing the host."""
    from jaxpar.planner.cost import STACK_PASSES

    m = ModelConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)
    w = Workload(m, 16, 128, "fp32")
    dev = get_device("cpu", {"mem_bandwidth": "1e9"})
    e = estimate(w, Strategy(data=8), dev)
    assert causal_blocks(128) == 2  # the CPU core stacks the probs of 2 causal query blocks: 3/4 of (T, T)
    saved, _ = layer_activation_bytes(w, 2, 1, "none", 1, 4, blocks=2)
    assert saved < layer_activation_bytes(w, 2, 1, "none", 1, 4)[0]
    want = 4 * STACK_PASSES * saved  # 4 layers
    assert e.traffic_s == pytest.approx(want * 8 / 1e9, rel=1e-12)  # 8 emulated devices share the host
    # remat=full stacks only the block inputs: less traffic, more compute
    full = estimate(w, Strategy(data=8, remat="full"), dev)
    assert full.traffic_s < e.traffic_s and full.compute_s > e.compute_s
    # GPU rows leave the stacking term out (mem_bandwidth 0; their own HBM term is tested below)
    assert estimate(w, Strategy(data=8), get_device("h100", {"hbm_bandwidth": "0"})).traffic_s == 0.0
    solo = estimate(w, Strategy(data=8), get_device("cpu", {"shared_host": "false"}))
    assert solo.compute_s * 8 == pytest.approx(estimate(w, Strategy(data=8), get_device("cpu")).compute_s, rel=1e-12)
    # boolean and zero-allowed overrides parse; a negative bandwidth does not
    assert get_device("cpu", {"reduce_scatter": "false", "mem_bandwidth": "0"}).mem_bandwidth == 0.0
    with pytest.raises(ConfigError) as err:
        get_device("cpu", {"mem_bandwidth": "-1"})
    assert str(err.value) == "device.mem_bandwidth='-1' must be >= 0 (0: not modelled)"


def test_gpu_elementwise_traffic_passes():
    """GPU rows: layers_run · passes · live bytes + the head's fp32 logits, at hbm_bandwidth;
    passes = 5 (write + read in forward, read + gradient write + read in backward) + 2 per
    forward recompute."""
    m = ModelConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)
    w = Workload(m, 16, 128)
    dev = get_device("h100", {"hbm_bandwidth": "1e12"})
    _, live = layer_activation_bytes(w, 2, 1, "none", 1)  # b = 16 / 8 rows per device
    head = 2 * 128 * 2 * 2048 * 4  # (T, b, V) fp32 logits and their gradient
    none = estimate(w, Strategy(data=8), dev)
    assert none.traffic_s == pytest.approx((4 * 5 * live + 5 * head) / 1e12, rel=1e-12)
    full = estimate(w, Strategy(data=8, remat="full"), dev)
    assert full.traffic_s == pytest.approx((4 * 7 * live + 5 * head) / 1e12, rel=1e-12)
    # on the critical path: the step grows by exactly the traffic time
    off = estimate(w, Strategy(data=8), get_device("h100", {"hbm_bandwidth": "0"}))
    assert none.step_time_s - off.step_time_s == pytest.approx(none.traffic_s, rel=1e-9)
    # a pipeline re-runs each stage: 7 passes over every layer run (iterations × layers per stage)
    pipe = estimate(w, Strategy(data=2, pipe=4, microbatches=4), dev)
    _, live8 = layer_activation_bytes(w, 2, 1, "none", 1)  # b = 16 / 2 / 4
    iters = 4 + 4 - 1
    assert pipe.traffic_s == pytest.approx((iters * 1 * 7 * live8 + 4 * 5 * head / 4) / 1e12, rel=1e-12)


def test_placement_order_decides_intra_or_inter_node():
    """jaxpar builds Megatron's layout (jaxpar.parallel.mesh.PLACEMENT, tensor innermost): tensor=8 inside
    pipe=8 stays in one node and pipe crosses nodes. The old pipe-innermost order spread the same
    tensor axis over 64 devices (8 nodes) at the inter-node bandwidth."""
    from jaxpar.parallel.mesh import PLACEMENT
    from jaxpar.planner.cost import JAXPAR_ORDER, MEGATRON_ORDER, PIPE_INNERMOST_ORDER

    assert Strategy().order == JAXPAR_ORDER == tuple(PLACEMENT) == MEGATRON_ORDER
    jx = axis_bandwidths(H100, Strategy(data=4, tensor=8, pipe=8))
    assert (jx["tensor"], jx["pipe"], jx["data"]) == (H100.bandwidth, H100.inter_bandwidth, H100.inter_bandwidth)
    old = axis_bandwidths(H100, Strategy(data=4, tensor=8, pipe=8, order=PIPE_INNERMOST_ORDER))
    assert (old["tensor"], old["pipe"]) == (H100.inter_bandwidth, H100.bandwidth)
    # the tensor all-reduces of that mesh took bandwidth-ratio times longer in the old placement
    w = Workload(ModelConfig(n_layer=16, n_embd=4096, n_head=32, vocab_size=32768, n_positions=1024), 64, 1024)
    a = estimate(w, Strategy(data=4, tensor=8, pipe=8, microbatches=16, order=PIPE_INNERMOST_ORDER), H100)
    b = estimate(w, Strategy(data=4, tensor=8, pipe=8, microbatches=16), H100)
    ratio = H100.bandwidth / H100.inter_bandwidth
    lat = a.collectives["tensor all-reduce"][0] - a.collectives["tensor all-reduce"][1] / H100.inter_bandwidth
    assert (a.comm_s["tensor"] - lat) == pytest.approx(ratio * (b.comm_s["tensor"] - lat), rel=1e-9)


def test_zero3_bytes_per_step_closed_form():
    """ZeRO-3 on fsdp=8 (H100: real reduce-scatter), one microbatch, no pipeline. Reference: the
    ZeRO paper's count, by hand: every block weight is gathered twice (forward, and again in
    backward), the embedding once, every gradient reduce-scattered once, each a ring moving
    (f-1)/f of the fp32 tensor per device; GPT-2 block = 12 D^2 + 13 D parameters."""
    m = ModelConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)
    L, D, V, P = m.n_layer, m.n_embd, m.vocab_size, m.n_positions
    block, embed = 12 * D * D + 13 * D, V * D + P * D + 2 * D
    ring = 7 / 8 * 4  # (f-1)/f of fp32 bytes
    cb = estimate(Workload(m, 16, 1024), Strategy(fsdp=8), H100).comm_bytes
    assert cb["all-gather"] == pytest.approx(ring * (embed + 2 * L * block), rel=1e-12)
    assert cb["reduce-scatter"] == pytest.approx(ring * (embed + L * block), rel=1e-12)
    assert cb["all-reduce"] == 0 and cb["ppermute"] == 0


def test_gpipe_ppermute_bytes_closed_form():
    """GPipe, S=4 stages, M=4 microbatches, one replica: each of the N = M + S - 1 = 7 schedule
    iterations shifts one (b, T, D) bf16 microbatch activation to the next stage in forward and
    its gradient back in backward. Reference: that count by hand (b = 16 rows / 4 microbatches)."""
    m = ModelConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)
    cb = estimate(Workload(m, 16, 1024), Strategy(pipe=4, microbatches=4), H100).comm_bytes
    assert cb["ppermute"] == 2 * 7 * (4 * 1024 * 1024 * 2)


def test_pipeline_gather_per_layer_closed_form():
    """pipeline.gather=layer vs step on fsdp=4 × pipe=2 (H100, bf16), M=4, L=4 (lmax=2 layers per
    stage), by hand: step gathers the stage's R·lmax block weights once per step and reduce-
    scatters their grads once, keeping three fp32 stage copies; layer gathers lmax layers every
    one of the N = M + S - 1 = 5 iterations in forward and again in the stage re-run, reduce-
    scatters them every iteration, and keeps three fp32 copies of one layer plus lmax bf16 copies
    (the re-run's saved weights). Ring (f-1)/f of fp32 bytes; GPT-2 block = 12 D² + 13 D."""
    m = ModelConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)
    D, lmax, N = m.n_embd, 2, 5
    block = 12 * D * D + 13 * D
    ring = 3 / 4 * 4
    w = Workload(m, 16, 1024)
    step = estimate(w, Strategy(data=2, fsdp=4, pipe=2, microbatches=4), H100)
    layer = estimate(w, Strategy(data=2, fsdp=4, pipe=2, microbatches=4, gather="layer"), H100)
    assert step.collectives["fsdp all-gather"][1] - layer.collectives["fsdp all-gather"][1] == pytest.approx(
        ring * block * lmax * (1 - 2 * N), rel=1e-12)
    assert step.collectives["fsdp reduce-scatter"][1] - layer.collectives["fsdp reduce-scatter"][1] == pytest.approx(
        ring * block * lmax * (1 - N), rel=1e-12)
    # data psum: step sums the gathered stage grads, layer the 1/f shards (ring over d=2: 1× bytes)
    assert step.collectives["data all-reduce"][1] - layer.collectives["data all-reduce"][1] == pytest.approx(
        4 * block * lmax * (1 - 1 / 4), rel=1e-12)
    assert step.memory["temporaries"] - layer.memory["temporaries"] == pytest.approx(
        (12 * lmax - 3 * 4 - lmax * 2) * block, rel=1e-12)
    assert step.memory["activations"] == layer.memory["activations"]
    assert layer.step_time_s > step.step_time_s  # 2N+N layer rounds instead of 2: slower here
    # without fsdp there is nothing to gather: the two are the same estimate
    a, b = (estimate(w, Strategy(data=8, pipe=2, microbatches=4, gather=g), H100) for g in ("step", "layer"))
    assert (a.memory, a.step_time_s) == (b.memory, b.step_time_s)


def test_pipeline_park_buffer_only_with_repeats():
    """pipeline.py parks stage S-1's outputs in an (M, mb, T, D) buffer only when R > 1 and M > S:
    GPipe (R = 1) with M = 8 > S = 2 keeps N = M + S - 1 stage inputs; the circular schedule
    (R = 2) keeps its N = (R-1)·M + M + S - 1 plus the M-slot buffer; both hold the replica
    batch's embedded inputs and outputs (2·M units) and one stage's residuals during its re-run."""
    m = ModelConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
    w = Workload(m, 16, 256, "fp32")  # fp32: no saved bf16 weight casts beside the activations
    unit = 256 * (16 / 8) * 256 * 4  # one (b, T, D) fp32 microbatch, b = 16 / 8 rows
    g, c = (estimate(w, Strategy(pipe=2, microbatches=8, repeats=r), H100) for r in (1, 2))
    sv = layer_activation_bytes(w, 2, 1, "none", 1)[0]
    assert g.memory["activations"] == pytest.approx((9 + 2 * 8) * unit + 2 * sv, rel=1e-12)
    assert c.memory["activations"] == pytest.approx((17 + 8 + 2 * 8) * unit + 1 * sv, rel=1e-12)


def test_1f1b_memory_flat_in_m_beyond_the_ring():
    """pipeline.schedule=1f1b (parallel/pipeline_1f1b.py) keeps min(M, 2S-1) stage inputs in a
    ring plus the two transfers the scan carries, and one stage's residuals while it is re-run;
    no embedded batch, no park buffer. Microbatches of a fixed b rows (batch = M·b): from
    M = 2S-1 on its memory does not grow, GPipe's grows by 3 units per microbatch (its stage
    input per iteration, the embedded input and the broadcast output)."""
    m = ModelConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
    S, b, T, D = 2, 2, 256, 256
    unit = T * b * D * 4  # one (b, T, D) fp32 microbatch
    sv = layer_activation_bytes(Workload(m, 2, T, "fp32"), b, 1, "none", 1)[0]

    def est(M, sched):
        return estimate(Workload(m, M * b, T, "fp32"), Strategy(pipe=S, microbatches=M, schedule=sched), H100)

    for M in (1, 2, 3, 8, 32):
        one, gp = est(M, "1f1b"), est(M, "gpipe")
        assert one.memory["activations"] == pytest.approx((min(M, 3) + 2) * unit + 2 * sv, rel=1e-12)
        assert gp.memory["activations"] == pytest.approx((M + S - 1 + 2 * M) * unit + 2 * sv, rel=1e-12)
        # one microbatch's logits (fp32 log-probs + grad) on the last stage vs M/S of them for GPipe,
        # and each tick's stacked fp32 stage weight grads (lmax = 2 layers) beside the accumulator
        head = 2 * T * b * 1024 * 4
        layer = 12 * D * D + 13 * D
        assert one.memory["temporaries"] == pytest.approx(head + 4 * 2 * layer, rel=1e-12)
        assert gp.memory["temporaries"] == pytest.approx(head * M / S, rel=1e-12)
    assert est(8, "1f1b").memory["total"] == est(32, "1f1b").memory["total"]
    assert est(32, "gpipe").memory["total"] - est(8, "gpipe").memory["total"] == pytest.approx(
        24 * 3 * unit + 24 / 2 * 2 * T * b * 1024 * 4, rel=1e-12)


def test_1f1b_schedule_closed_form():
    """1f1b on data=2 × tensor=2 × pipe=4 (H100, bf16), M = 8, L = 8 (lmax = 2), by hand: M + 2S - 2
    = 14 ticks, each shifting one (b, T, D) activation forward and one gradient back; GPipe's
    critical path (M + S - 1)·(F + B), so the same bubble; the head runs on the last stage for every
    microbatch (M heads there, GPipe spreads the batch's head over S ranks); per device M forwards
    and M re-run + backwards of lmax layers, 6 tensor all-reduces each (the re-run cannot reuse the
    forward's, a tick apart), plus 2 per head; no pipe gather/broadcast of the embedded batch."""
    m = ModelConfig(n_layer=8, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)
    w = Workload(m, 32, 1024)
    S, M, b, T, D, V = 4, 8, 2, 1024, 1024, 32768
    unit = T * b * D * 2
    one = estimate(w, Strategy(data=2, tensor=2, pipe=S, microbatches=M, schedule="1f1b"), H100)
    gp = estimate(w, Strategy(data=2, tensor=2, pipe=S, microbatches=M), H100)
    assert one.collectives["pipe ppermute"][1] == 2 * 14 * unit
    assert gp.collectives["pipe ppermute"][1] == 2 * 11 * unit
    assert "pipe all-gather" not in one.collectives and "pipe all-reduce" not in one.collectives
    assert "pipe all-gather" in gp.collectives
    assert one.bubble == gp.bubble == pytest.approx(3 / 11)
    ar = all_reduce(2, unit, 0.0, 1.0)[1]  # ring over tensor = 2: one unit sent
    assert one.collectives["tensor all-reduce"][1] == pytest.approx((M * 2 * 6 + 2 * M) * ar, rel=1e-12)
    # compute: layers identical (4 forward-equivalents per layer run, 11 · lmax runs on the
    # critical path); the head: all M microbatches on the last stage instead of M / S
    fl_head = 3 * 2 * T * b * D * V / 2
    rows, cols = T * b, D / 2
    eff = H100.efficiency * rows / (rows + H100.knee_rows) * cols / (cols + H100.knee_cols)
    assert one.compute_s - gp.compute_s == pytest.approx(M * fl_head * (1 - 1 / S) / (H100.peak_flops * eff), rel=1e-9)
    with pytest.raises(ValueError, match="1f1b runs one repeat"):
        Strategy(pipe=2, repeats=2, schedule="1f1b")
    assert Strategy(pipe=2, repeats=2).schedule == "circular" and Strategy(pipe=2).schedule == "gpipe"


def test_1f1b_one_layer_stages_and_bf16_ring_on_cpu():
    """Two 1f1b terms the closed-form tests above (lmax = 2, fp32 / native bf16) leave open.
    One-layer stages (L = S = 2): XLA inlines the stage's layer scan, so no stacked stage-grad
    copy: the temporaries are one microbatch's logits (fp32 log-probs + grad) and nothing else.
    bf16 on the CPU spec (native_bf16=False: the math upcasts to fp32): the ring slots are still
    stored in bf16, so each extra slot (M = 1 -> 3, b rows fixed) costs T·b·D·2 bytes, not ·4."""
    m = ModelConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
    S, b, T, D = 2, 2, 256, 256

    def est(M, precision, dev):
        return estimate(Workload(m, M * b, T, precision), Strategy(pipe=S, microbatches=M, schedule="1f1b"), dev)

    for M in (1, 4):
        assert est(M, "fp32", H100).memory["temporaries"] == 2 * T * b * 1024 * 4
    cpu = get_device("cpu")
    assert not cpu.native_bf16
    for precision, nbytes in (("bf16", 2), ("fp32", 4)):
        grow = est(3, precision, cpu).memory["activations"] - est(1, precision, cpu).memory["activations"]
        assert grow == 2 * T * b * D * nbytes, precision
