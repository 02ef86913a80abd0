"""Model parity, fp32, one device: logits, loss, every parameter's gradient, and every parameter
after AdamW steps with clipping and decay masks, for gpt2-tiny and a non-preset shape (odd head
count, vocab 101). Bounds: parity_tests/tolerances.py (MODEL)."""

import numpy as np
import pytest

from parity_tests.common import ODD, PARITY_TRAIN, TINY, load_torch, model_parity, worst
from parity_tests.tolerances import MODEL, U_FP32

torch = pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")

N_TENSORS = {"gpt2-tiny": 4 + 12 * TINY.n_layer, "odd": 4 + 12 * ODD.n_layer}  # wte wpe ln_f.{w,b} + 12/layer


@pytest.fixture(scope="module", params=["gpt2-tiny", "odd"])
def parity(request, shared):
    init_dir, data_dir = shared[request.param]
    return request.param, model_parity(init_dir, data_dir)


def test_shared_start_is_bitwise_identical(shared):
    """Both converters read the one numpy init exactly (no cast, no transpose slip), tied lm_head."""
    from gpt2common import hf
    from jaxpar.models import gpt2

    for name, cfg in (("gpt2-tiny", TINY), ("odd", ODD)):
        init_dir, _ = shared[name]
        ref = hf.to_hf_state_dict(cfg, gpt2.init_params(cfg, 0))
        mcfg, params = hf.load_hf(init_dir)
        assert mcfg == cfg
        jx = hf.to_hf_state_dict(mcfg, params)
        model = load_torch(init_dir)
        th = {n: p.detach().numpy() for n, p in model.named_parameters()}
        assert set(ref) == set(jx) == set(th) and len(ref) == N_TENSORS[name]
        for k in ref:
            assert np.array_equal(ref[k], jx[k]) and np.array_equal(ref[k], th[k]), k
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_same_batches_in_both_frameworks(shared):
    """torchref's workers draw their rows from the very global batch jaxpar trains on."""
    from gpt2common import data
    from torchref.config import RefConfig
    from torchref.run_config import RunConfig, TrainSettings
    from torchref.runtime import Context, Job

    init_dir, data_dir = shared["gpt2-tiny"]
    train = TrainSettings(**{f: getattr(PARITY_TRAIN, f) for f in TrainSettings.__dataclass_fields__})
    cfg = RunConfig(model=TINY, train=train, seed=0)
    ctx = Context(Job(cfg, RefConfig(strategy="distributed-ps", workers=2), data_dir, init_dir, "/nonexistent"), 0, 2)
    ds = data.Dataset.open(data_dir, TINY.vocab_size, PARITY_TRAIN.seq_len)
    for step in (0, 1, 9):
        x, y = data.train_batch(ds, 32, 8, 0, step)
        rows = [ctx.shard(step, w, 2) for w in range(2)]
        assert np.array_equal(np.concatenate([r[0].numpy() for r in rows]), x)
        assert np.array_equal(np.concatenate([r[1].numpy() for r in rows]), y)
    assert not np.array_equal(data.train_batch(ds, 32, 8, 0, 0)[0], data.train_batch(ds, 32, 8, 0, 1)[0])


def test_logits(parity):
    _, r = parity
    assert r.logits_abs <= MODEL["logits_abs"], r.logits_abs


def test_loss(parity):
    _, r = parity
    assert r.loss_rel <= MODEL["loss_rel"], (r.loss_jax, r.loss_torch)
    # a real loss near ln(V) at init, not a degenerate 0
    assert abs(r.loss_torch - np.log(r.model["vocab_size"])) < 0.3


def test_every_gradient(parity):
    name, r = parity
    assert r.n_params == len(r.grad_rel) == N_TENSORS[name]
    assert worst(r.grad_rel)[1] <= MODEL["grad_rel"], worst(r.grad_rel)


def test_every_parameter_after_adamw_steps(parity):
    name, r = parity
    assert r.grad_norm > PARITY_TRAIN.grad_clip  # clipping was active at step 1
    for k, per in r.update_rel.items():
        assert len(per) == N_TENSORS[name]
        assert worst(per)[1] <= MODEL["update_rel"], (k, worst(per))


def test_optimizer_mapping():
    """Every hyper-parameter of jaxpar's optax chain has its torch.optim counterpart (OPTIMIZER_MAP)."""
    import jax
    import optax

    from gpt2common import hf
    from jaxpar.models import gpt2
    from jaxpar.train import decay_mask, lr_schedule, make_optimizer
    from torchref import model as tm

    cfg = ODD
    # decay mask: jaxpar's tree mask, carried to HF names through the converter, == torchref's groups
    mask = decay_mask(gpt2.init_params(cfg, 0))
    shapes = gpt2.param_shapes(cfg)
    as_arrays = jax.tree.map(lambda m, s: np.full(s, float(m), np.float32), mask, shapes,
                             is_leaf=lambda x: isinstance(x, tuple))
    jax_decays = {k for k, v in hf.to_hf_state_dict(cfg, as_arrays).items() if v.flat[0] == 1.0}
    model = tm.build_model(hf.hf_config_dict(cfg), hf.to_hf_state_dict(cfg, gpt2.init_params(cfg, 0)))
    named = list(model.named_parameters())
    opt = tm.make_optimizer(named, PARITY_TRAIN)
    ids = {id(p): n for n, p in named}
    torch_decays = {ids[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert jax_decays == torch_decays and len(jax_decays) == 4 * cfg.n_layer
    for g in opt.param_groups:
        assert g["betas"] == (PARITY_TRAIN.beta1, PARITY_TRAIN.beta2) and g["eps"] == PARITY_TRAIN.eps
        assert g["weight_decay"] in (0.0, PARITY_TRAIN.weight_decay)
        assert g["amsgrad"] is False and g["maximize"] is False
    # schedule: optax at the update count == torchref's lr_at(step), warmup and cosine parts
    for tc in (PARITY_TRAIN, PARITY_TRAIN.__class__(steps=10, warmup_steps=3, lr=1e-3, min_lr_ratio=0.1)):
        sched = lr_schedule(tc)
        for s in range(tc.steps + 1):
            # optax evaluates the cosine in fp32, lr_at in fp64: a few fp32 ulps apart
            assert abs(float(sched(s)) - tm.lr_at(tc, s)) <= 4 * U_FP32 * tc.lr, (tc.warmup_steps, s)
    # clipping: optax has no epsilon; torchref's clip_grads_ matches it, torch's built-in would not.
    # A global norm of 2e-6 against max_norm 1e-6: optax scales by 0.5, clip_grad_norm_ by 1e-6/3e-6.
    g = np.full((4,), 1e-6, np.float32)  # norm 2e-6
    tx = optax.clip_by_global_norm(1e-6)
    want = np.asarray(tx.update({"a": g}, tx.init({"a": g}))[0]["a"])
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.from_numpy(g.copy())
    tm.clip_grads_([p], 1e-6)
    assert np.allclose(p.grad.numpy(), want, rtol=1e-6) and np.allclose(want, g / 2, rtol=1e-6)
    p.grad = torch.from_numpy(g.copy())
    torch.nn.utils.clip_grad_norm_([p], 1e-6)
    assert abs(p.grad.numpy()[0] / want[0] - 2 / 3) < 1e-3  # why torchref does not use it
    # Adam step 1 with the full chain, by hand: bias-corrected, eps outside the sqrt, decoupled decay
    tx = make_optimizer(PARITY_TRAIN)
    p0 = {"h": {"mlp": {"c_fc": {"weight": np.array([[0.5, -0.5]], np.float32)}}}}
    g0 = {"h": {"mlp": {"c_fc": {"weight": np.array([[3e-9, -0.2]], np.float32)}}}}
    u, _ = tx.update(g0, tx.init(p0), p0)
    gc = g0["h"]["mlp"]["c_fc"]["weight"]  # norm 0.2 < clip 0.5: unclipped
    lr, wd, eps = PARITY_TRAIN.lr, PARITY_TRAIN.weight_decay, PARITY_TRAIN.eps
    expect = -lr * (gc / (np.abs(gc) + eps) + wd * p0["h"]["mlp"]["c_fc"]["weight"])
    assert np.allclose(np.asarray(u["h"]["mlp"]["c_fc"]["weight"]), expect, rtol=1e-5, atol=0)
    tp = torch.nn.Parameter(torch.tensor([[0.5, -0.5]]))
    tp.grad = torch.tensor(gc)
    topt = torch.optim.AdamW([tp], lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=wd, foreach=False)
    topt.step()
    assert np.allclose(tp.detach().numpy() - 0.5 * np.array([[1, -1]]), expect, rtol=1e-5, atol=0)


def test_report_model_row(parity):
    """The report's model section carries these numbers and verdicts."""
    from parity_tests.report import markdown, model_row

    name, r = parity
    row = model_row(name, r)
    assert row["pass"] and row["logits_abs"] == r.logits_abs and row["grad_params"] == N_TENSORS[name]
    md = markdown({"model_parity": [row], "pass": True})
    assert f"| {name} | {r.logits_abs:.1e} |" in md and md.count("| PASS |") == 1 and "clip_grad_norm_" in md
