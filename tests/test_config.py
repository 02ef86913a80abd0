"""Config: presets, overrides, YAML, round trip through config.json."""

import pytest

from jaxpar import config as C


def test_every_preset_loads_and_validates():
    for name, mc in C.PRESETS.items():
        cfg = C.resolve([f"model={name}", "train.seq_len=128"])
        assert cfg.model == mc and cfg.model_name == name
        assert mc.n_embd % mc.n_head == 0
    assert C.PRESETS["gpt2-xl"].head_dim == 64 and C.PRESETS["gpt2-tiny"].num_params() == 462_336


def test_overrides_refine_preset_in_any_order():
    cfg = C.resolve(["model.n_layer=3", "model=gpt2-tiny", "mesh.data=-1", "pipeline.layers_per_stage=[1,2]",
                     "precision=fp32", "train.lr=1e-3", "resume=true"])
    assert cfg.model.n_layer == 3 and cfg.model.n_embd == 128
    assert cfg.mesh.data == -1 and cfg.pipeline.layers_per_stage == (1, 2)
    assert cfg.train.lr == 1e-3 and cfg.resume is True and cfg.precision == "fp32"


def test_yaml_then_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model: gpt2-tiny\ntrain:\n  steps: 7\n  lr: 0.01\nmesh: {data: 2}\n")
    cfg = C.resolve(["train.steps=9"], str(y))
    assert (cfg.train.steps, cfg.train.lr, cfg.mesh.data, cfg.model_name) == (9, 0.01, 2, "gpt2-tiny")


def test_a_value_may_hold_an_equals_sign():
    """key=value splits at the first '=': a path or a prompt may hold '=' itself."""
    from gpt2common.grammar import parse_kv

    assert parse_kv(["prompt=a=b", "data=/d/x=y", "out="]) == {"prompt": "a=b", "data": "/d/x=y", "out": ""}
    cfg = C.resolve(["out=runs/lr=1e-3", "data=corpus/a=b.txt"])
    assert (cfg.out, cfg.data) == ("runs/lr=1e-3", "corpus/a=b.txt")


def test_to_from_dict_round_trip():
    cfg = C.resolve(["model=gpt2-tiny", "pipeline.layers_per_stage=[1,1]", "mesh.pipe=2"])
    assert C.from_dict(C.to_dict(cfg)) == cfg


@pytest.mark.parametrize("args,msg", [
    (["mesh.data=-1", "mesh.fsdp=-1"], "at most one mesh axis may be -1 (got {'data': -1, 'fsdp': -1, 'tensor': 1, 'pipe': 1})"),
    (["mesh.tensor=0"], "mesh sizes must be positive or -1 (got {'tensor': 0})"),
    (["pipeline.schedule=pipedream"], "pipeline.schedule='pipedream' must be one of gpipe, circular, 1f1b, zb, interleaved"),
    (["pipeline.gather=stage"], "pipeline.gather='stage' must be one of step, layer"),
    (["model.vocab_size=70000"], "model.vocab_size=70000 does not fit uint16 token files (max 65536)"),
    # a negative LayerNorm epsilon was accepted: NaN at step 1, blamed on train.lr
    (["model.layer_norm_epsilon=-1"], "model.layer_norm_epsilon=-1.0 must be positive and finite"),
])
def test_validation_messages(args, msg):
    with pytest.raises(C.ConfigError) as e:
        C.resolve(args)
    assert str(e.value) == msg


def test_the_readme_defaults():
    """The defaults README.md states, read off a resolved empty command line: `precision=bf16`
    (default), `pipeline.gather=step` (default), `model.dropout` 0 (default, also with `init=`),
    `data=` empty = the built-in corpus, tokenized bytewise, `model.attention=auto`,
    `progress=auto` (a bar on a TTY), `eval.windows` all that fit (0), `train.skip_nonfinite`
    off (a non-finite step stops the run), a checkpoint about every 10 minutes (`train.ckpt_minutes`)
    and at the end, no step interval unless `train.ckpt_every`, the newest 2 kept."""
    cfg = C.resolve([])
    assert (cfg.precision, cfg.pipeline.gather, cfg.pipeline.schedule, cfg.model.dropout) == ("bf16", "step", "gpipe", 0.0)
    assert (cfg.data, cfg.tokenizer, cfg.model.attention, cfg.progress) == ("", "byte", "auto", "auto")
    assert (cfg.eval.windows, cfg.train.skip_nonfinite, cfg.train.ckpt_every) == (0, False, 0)
    assert (cfg.train.ckpt_minutes, cfg.train.keep_checkpoints) == (10.0, 2)
    assert all(p.dropout == 0.0 and p.attention == "auto" for p in C.PRESETS.values())


@pytest.mark.parametrize("args,refused,msg", [
    # GPT-2's own shape: seq_len = n_positions (1024/1024; 256/256 for gpt2-tiny) is the longest allowed window
    (["train.seq_len=256"], ["train.seq_len=257"], "train.seq_len=257 exceeds model.n_positions=256"),
    # min_lr_ratio = 1: a constant lr after warmup ("in [0, 1]" says both ends are allowed)
    (["train.min_lr_ratio=1"], ["train.min_lr_ratio=1.0000001"], "train.min_lr_ratio=1.0000001 must be in [0, 1]"),
    (["train.min_lr_ratio=0"], ["train.min_lr_ratio=-0.5"], "train.min_lr_ratio=-0.5 must be in [0, 1]"),
    (["train.beta1=0"], ["train.beta1=1"], "train.beta1=1.0 must be in [0, 1)"),
    # lr = 0 trains nothing (every update is 0): refused, the smallest positive lr is not
    (["train.lr=1e-9"], ["train.lr=0"], "train.lr=0.0 must be positive"),
    # grad_clip = 0 disables clipping; a negative one would disable it silently (grad_clip > 0 gates it)
    (["train.grad_clip=0"], ["train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0"),
    # dropout 1 drops everything: inverted dropout would divide by 1 - p = 0
    (["model.dropout=0"], ["model.dropout=1"], "model.dropout=1.0 must be in [0, 1)"),
    # eval averages over eval_batches batches: 0 was accepted and the first eval divided by zero
    # (eval_every=0 is how evaluation is turned off)
    (["train.eval_batches=1"], ["train.eval_batches=0"], "train.eval_batches=0 must be positive"),
    # LayerNorm divides by sqrt(var + eps): any positive eps is a LayerNorm, 0 divides by zero on a flat row
    (["model.layer_norm_epsilon=1e-12"], ["model.layer_norm_epsilon=0"],
     "model.layer_norm_epsilon=0.0 must be positive and finite"),
    # uint16 token files hold ids 0..65535: a vocab of 65536 fits exactly
    (["model.vocab_size=65536"], ["model.vocab_size=65537"],
     "model.vocab_size=65537 does not fit uint16 token files (max 65536)"),
])
def test_the_inclusive_ends_of_each_range_are_accepted(args, refused, msg):
    """Each range's end that its error text includes is accepted; one step past it is refused
    with that text. Reference: the error texts' own interval notation."""
    base = ["model=gpt2-tiny"]
    C.resolve(base + args)
    with pytest.raises(C.ConfigError) as e:
        C.resolve(base + refused)
    assert str(e.value) == msg


def test_a_layer_norm_epsilon_that_is_not_finite_is_refused_however_it_arrives():
    """The key=value parser refuses nan/inf, but validate also sees models it did not parse: an HF
    config.json read by init= (json reads NaN and Infinity), a Config built in code."""
    from gpt2common.model import ModelConfig

    for eps in (float("nan"), float("inf")):
        with pytest.raises(C.ConfigError) as e:
            C.validate(C.Config(model=ModelConfig(layer_norm_epsilon=eps)))
        assert str(e.value) == f"model.layer_norm_epsilon={eps} must be positive and finite"
    with pytest.raises(C.ConfigError) as e:
        C.resolve(["model.layer_norm_epsilon=nan"])
    assert str(e.value) == "model.layer_norm_epsilon='nan' is not a finite number"


def test_min_lr_ratio_one_keeps_the_peak_after_warmup():
    """train.min_lr_ratio=1: lr(s) = lr for every s >= W. Reference: the schedule's definition
    (torchref.model.lr_at's docstring) by hand: warmup lr*(s+1)/(W+1), then r = 1 -> lr."""
    from jaxpar.train import lr_schedule

    tc = C.resolve(["train.lr=1e-3", "train.min_lr_ratio=1", "train.warmup_steps=3", "train.steps=10"]).train
    got = [float(lr_schedule(tc)(s)) for s in range(10)]
    assert got == pytest.approx([2.5e-4, 5e-4, 7.5e-4] + [1e-3] * 7, rel=1e-6)


def test_model_name_is_a_preset_or_an_hf_label():
    """A run's config.json names its model `model_name`: a preset applies as model= does, an hf:<dir>
    label (a converted run) is kept, anything else is one error line."""
    from jaxpar.config import PRESETS, ConfigError, resolve

    assert resolve(["model_name=gpt2-tiny"]).model == PRESETS["gpt2-tiny"]
    assert resolve(["model_name=hf:exported", "model=gpt2-tiny"]).model_name == "gpt2-tiny"
    assert resolve(["model_name=hf:exported"]).model_name == "hf:exported"
    with pytest.raises(ConfigError) as e:
        resolve(["model_name=x"])
    assert str(e.value) == ("model_name='x' is neither a preset (gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl) "
                            "nor an hf:<dir> label")
