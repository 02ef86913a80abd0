"""torchref config, error messages (exact text, exit 2) and the optimizer's match with optax.
No worker processes here: everything runs in this process or a CLI subprocess that fails fast."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import ConfigError
from torchref.config import resolve_ref

TINY = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=8"]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "torchref", *args], capture_output=True, text=True, check=False, env=env,
                          timeout=120)


@pytest.mark.parametrize("args, msg", [
    (["strategy=ring"], ("strategy='ring' is unknown (choose from single, single-ps, distributed-ps, horovod, "
                         "distributed-ps-amp, horovod-amp)")),
    (["strategy=horovod", "workers=1"], "strategy=horovod needs workers >= 2 (got workers=1)"),
    (["strategy=single-ps"], "strategy=single-ps needs workers >= 2 (got workers=1)"),
    (["strategy=distributed-ps", "workers=3"], "train.batch_size=8 is not divisible by workers=3"),
    (["strategy=single", "workers=2"], "strategy=single runs one process; workers=2 must be 1"),
    (["horovod.algorithm=tree"], "horovod.algorithm='tree' must be mpi or ring"),
    (["horovod.compression=int8"], "horovod.compression='int8' must be none or fp16"),
    (["amp.dtype=fp8"], "amp.dtype='fp8' must be bf16 or fp16"),
    (["ps.async=true", "strategy=horovod", "workers=2"], "ps.async=true needs strategy=single-ps (got strategy=horovod)"),
    (["ps.bogus=1"], "unknown key 'ps.bogus' (valid: ps.async, ps.max_staleness)"),
    (["train.bogus=1"], "unknown key 'train.bogus'"),
    (["precision=bf16"], "precision=bf16 contradicts strategy=single (it computes in fp32)"),
    (["strategy=horovod", "workers=4", "train.grad_accum=2", "train.batch_size=12"],
     "train.batch_size=12 is not divisible by workers×train.grad_accum=4×2"),
    (["mesh.tensor=2"], "mesh.tensor=2 is not supported by torchref (torchref is data-parallel only; use workers=N)"),
    (["timeout_s=0"], "timeout_s=0.0 must be positive"),  # a 0 s collective timeout fails every collective
    (["strategy=single-ps", "workers=2", "ps.async=true", "ps.max_staleness=-1"], "ps.max_staleness=-1 must be >= 0"),
    # a section given a value: torchref's own (its first key: ps.async) and one of jaxpar's
    (["ps=1"], "ps='1': ps is a section, not a key; set its keys (ps.async=..., or a mapping under `ps:` in YAML)"),
    (["train=5"], "train='5': train is a section, not a key; set its keys (train.steps=..., or a mapping under "
                  "`train:` in YAML)"),
])
def test_config_errors_exact_text(args, msg):
    with pytest.raises(ConfigError) as e:
        resolve_ref(TINY + args)
    assert str(e.value).startswith(msg), str(e.value)


def test_torchref_keys_parse_and_the_rest_reach_the_run_config():
    cfg, ref = resolve_ref(TINY + ["strategy=horovod-amp", "workers=4", "ps.max_staleness=5", "horovod.fusion_mb=0.5",
                                   "horovod.algorithm=ring", "amp.dtype=bf16", "train.lr=3e-4", "seed=7"])
    assert (ref.strategy, ref.workers, ref.ps.max_staleness, ref.horovod.fusion_mb) == ("horovod-amp", 4, 5, 0.5)
    assert (cfg.model.n_layer, cfg.train.lr, cfg.seed, cfg.precision) == (2, 3e-4, 7, "bf16")
    _, ref = resolve_ref(TINY + ["strategy=single-ps", "workers=2", "ps.async=true"])
    assert ref.ps.async_ is True


@pytest.mark.parametrize("args, line", [
    (["strategy=nope"], ("error: strategy='nope' is unknown (choose from single, single-ps, distributed-ps, "
                         "horovod, distributed-ps-amp, horovod-amp)")),
    (["strategy=horovod", "workers=1"], "error: strategy=horovod needs workers >= 2 (got workers=1)"),
    (["strategy=distributed-ps", "workers=3"], "error: train.batch_size=8 is not divisible by workers=3"),
])
def test_cli_errors_exit_2_one_line(args, line):
    r = cli("train", *TINY, *args)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n")


def test_cli_refusal_in_the_launchers_prepare_prints_only_the_error(tmp_path):
    """data= is read in launch.prepare, the last check before any worker: the config line, printed
    once the run starts, is not printed above the error."""
    r = cli("train", *TINY, "strategy=single", f"data={tmp_path / 'none.txt'}", f"out={tmp_path / 'run'}")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"error: data='{tmp_path / 'none.txt'}' does not exist\n"


def test_cli_mpiexec_missing_says_how_to_install(tmp_path):
    # A PATH holding only this python: mpiexec cannot be found.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    r = cli("train", *TINY, "strategy=horovod", "workers=2", f"out={tmp_path}/run", env=dict(os.environ, PATH=str(bindir)))
    # refused by the launcher's checks, after the config resolved: the config line is printed only
    # for a run that starts (it was printed above the error)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("error: strategy=horovod needs mpiexec: pip install mpi4py mpich "
                        "(or pip install -e '.[mpi]')\n")


def test_mpi4py_missing_says_how_to_install(monkeypatch):
    import importlib.util

    from torchref import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        launch.check_mpi()
    assert str(e.value) == "strategy=horovod needs mpi4py: pip install mpi4py mpich (or pip install -e '.[mpi]')"


# ----------------------------------------------------------------------------- optimizer == optax

def test_lr_schedule_matches_optax():
    import optax

    from jaxpar.config import TrainConfig
    from torchref.model import lr_at

    for t in (TrainConfig(steps=50, warmup_steps=10, lr=6e-4), TrainConfig(steps=20, warmup_steps=0, lr=1e-3),
              TrainConfig(steps=10, warmup_steps=2, lr=1e-3, min_lr_ratio=0.0)):
        # warmup lr*(s+1)/(W+1) (nanoGPT/torchtitan), then optax's own cosine from the peak
        cos = optax.cosine_decay_schedule(t.lr, t.steps - t.warmup_steps, alpha=t.min_lr_ratio)
        for s in range(t.steps + 3):
            want = t.lr * (s + 1) / (t.warmup_steps + 1) if s < t.warmup_steps else float(cos(s - t.warmup_steps))
            # optax evaluates the schedule in float32: agree to fp32 roundoff of the peak lr.
            assert lr_at(t, s) == pytest.approx(want, rel=0, abs=t.lr * 2**-22), (t, s)


def test_clip_and_adamw_step_match_optax():
    """Two steps of clip + AdamW with the decay mask: torch mirror vs optax, same numbers."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    from jaxpar.config import TrainConfig
    from jaxpar.train import lr_schedule
    from torchref.model import clip_grads_, lr_at, make_optimizer, set_lr

    torch.set_num_threads(1)
    t = TrainConfig(steps=10, warmup_steps=1, lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    rng = np.random.default_rng(0)
    names = {"transformer.h.0.attn.c_attn.weight": (8, 24), "transformer.h.0.attn.c_attn.bias": (24,),
             "transformer.wte.weight": (16, 8), "transformer.h.0.mlp.c_proj.weight": (32, 8)}
    p0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in names.items()}
    grads = [{n: (rng.standard_normal(s) * 0.5).astype(np.float32) for n, s in names.items()} for _ in range(2)]
    # step 2 just above the threshold (global norm 1.5 x grad_clip): clipping must act there too
    norm2 = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads[1].values()))
    grads[1] = {n: (g * (1.5 * t.grad_clip / norm2)).astype(np.float32) for n, g in grads[1].items()}
    tp = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in p0.items()}
    opt = make_optimizer(list(tp.items()), t)
    mask = {n: n.endswith("weight") and "wte" not in n for n in names}
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(lr_schedule(t),
                                 b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay, mask=mask))
    jp = {n: jnp.asarray(v) for n, v in p0.items()}
    state = tx.init(jp)
    for step, g in enumerate(grads):
        for n, p in tp.items():
            p.grad = torch.from_numpy(g[n].copy())
        clip_grads_(list(tp.values()), t.grad_clip)
        set_lr(opt, lr_at(t, step))
        opt.step()
        upd, state = tx.update({n: jnp.asarray(v) for n, v in g.items()}, state, jp)
        jp = optax.apply_updates(jp, upd)
    jax.block_until_ready(jp)
    for n in names:
        np.testing.assert_allclose(tp[n].detach().numpy(), np.asarray(jp[n]), rtol=1e-6, atol=1e-7)
    assert not np.allclose(tp["transformer.wte.weight"].detach().numpy(), p0["transformer.wte.weight"])


def test_accumulate_returns_the_mean_loss_and_the_mean_gradient():
    """`strategies.base.accumulate` over A = 2 microbatches of 3 rows: it returns the mean of the
    two microbatch losses and leaves in .grad the gradient of the 6-row mean loss. Reference: one
    cross-entropy over all 6 rows. loss_fn computes in fp32, so the two differ by fp32 rounding
    only (a few units of 6e-8); a summed or unscaled microbatch loss is off by a factor 2."""
    import contextlib
    import types

    import torch

    from torchref.strategies.base import accumulate

    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 11)

    def model(input_ids):
        return types.SimpleNamespace(logits=emb(input_ids))

    x, y = torch.randint(0, 11, (6, 4)), torch.randint(0, 11, (6, 4))
    ctx = types.SimpleNamespace(microbatches=lambda step, worker, n: [(x[0::2], y[0::2]), (x[1::2], y[1::2])],
                                amp_context=contextlib.nullcontext)
    got = accumulate(ctx, 0, 0, 1, model)
    g = emb.weight.grad.clone()
    emb.weight.grad = None
    want = torch.nn.functional.cross_entropy(emb(x).reshape(-1, 11), y.reshape(-1))
    want.backward()
    assert got == pytest.approx(float(want.detach()), rel=1e-6)
    assert float((g - emb.weight.grad).abs().max()) <= 1e-6 * float(emb.weight.grad.abs().max())


def test_zero_staleness_and_small_timeouts_are_valid():
    """ps.max_staleness=0 (apply only gradients of the newest weights) and a short positive timeout pass."""
    _, ref = resolve_ref(TINY + ["strategy=single-ps", "workers=2", "ps.async=true", "ps.max_staleness=0",
                                 "timeout_s=0.5"])
    assert (ref.ps.max_staleness, ref.timeout_s) == (0, 0.5)


def test_metrics_rows_count_tokens_and_progress_shows_the_last_step(tmp_path, capsys):
    """torchref.runtime.Metrics: tokens/s = batch_size * seq_len / step time; a progress line every
    train.log_every steps and at the last step. Reference: numbers written down here (B=4, T=16,
    0.5 s a step -> 128 tokens/s; 5 steps, log_every=3 -> steps 3 and 5)."""
    import json
    from types import SimpleNamespace

    from torchref.runtime import Metrics

    ctx = SimpleNamespace(job=SimpleNamespace(out=str(tmp_path)),
                          t=SimpleNamespace(batch_size=4, seq_len=16, log_every=3, steps=5))
    m = Metrics(ctx, strategy="single")
    for step in range(1, 6):
        m.log(step, 2.0, 0.5, lr=1e-3)
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens_per_s"], r["strategy"]) for r in rows] == [(s, 128.0, "single") for s in range(1, 6)]
    assert capsys.readouterr().out == ("step 3/5  loss 2.0000  128 tok/s  500 ms\n"
                                       "step 5/5  loss 2.0000  128 tok/s  500 ms\n")


def test_seq_len_may_fill_the_context_but_not_exceed_it():
    """train.seq_len == model.n_positions is a full-context window (jaxpar accepts it too); one more is refused."""
    cfg, _ = resolve_ref(["model=gpt2-tiny", "train.seq_len=256", "train.batch_size=8"])
    assert (cfg.train.seq_len, cfg.model.n_positions) == (256, 256)
    with pytest.raises(ConfigError) as e:
        resolve_ref(["model=gpt2-tiny", "train.seq_len=257", "train.batch_size=8"])
    assert str(e.value) == "train.seq_len=257 exceeds model.n_positions=256"


def test_async_ps_applies_a_gradient_exactly_max_staleness_old():
    """single_ps.applies(version, computed_on, steps, max_staleness): staleness = version - computed_on
    is applied up to and including max_staleness, never once the server reached train.steps."""
    from torchref.strategies.single_ps import applies

    assert [applies(5, c, 10, 2) for c in (5, 4, 3, 2, 1)] == [True, True, True, False, False]
    assert [applies(5, c, 10, 0) for c in (5, 4)] == [True, False]
    assert [applies(v, v, 10, 3) for v in (8, 9, 10, 11)] == [True, True, False, False]
