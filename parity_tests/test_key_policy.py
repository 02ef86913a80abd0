"""Every key of `jaxpar train` is accounted for by torchref: mirrored, same-math, no-math or
rejected (`torchref.run_config.KEY_POLICY`). The keys are enumerated from jaxpar's config dataclasses,
so a key added to jaxpar fails here until someone decides what torchref does with it. torchref holds
its keys in its own dataclasses (it imports nothing from jaxpar): the defaults, types and error texts
it re-states are compared with jaxpar's here."""

import dataclasses
import os

import pytest

from gpt2common import hf
from jaxpar import config as C
from jaxpar.config import ConfigError
from torchref.config import resolve_ref
from torchref.run_config import HELD, IGNORED, KEY_POLICY, RunConfig, TrainSettings

KINDS = {"mirrored", "same-math", "no-math", "rejected"}
TINY = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=8"]

# A valid non-default value of every key (for gpt2-tiny, T=32, B=8).
SAMPLE = {
    "model": "gpt2-medium", "model.n_layer": "3", "model.n_embd": "64", "model.n_head": "2", "model.vocab_size": "300",
    "model.n_positions": "64", "model.dropout": "0.1", "model.layer_norm_epsilon": "1e-6",
    "model.attention": "xla",
    "mesh.data": "2", "mesh.fsdp": "2", "mesh.tensor": "2", "mesh.pipe": "2", "pipeline.microbatches": "2",
    "pipeline.schedule": "circular", "pipeline.repeats": "2", "pipeline.layers_per_stage": "1,1",
    "pipeline.gather": "layer",
    "train.steps": "7", "train.batch_size": "16", "train.seq_len": "16", "train.lr": "1e-3", "train.min_lr_ratio": "0.5",
    "train.warmup_steps": "3", "train.weight_decay": "0.01", "train.beta1": "0.8", "train.beta2": "0.99",
    "train.eps": "1e-6", "train.grad_clip": "0.5", "train.grad_accum": "2", "train.eval_every": "5",
    "train.eval_batches": "2", "train.ckpt_every": "3", "train.ckpt_minutes": "5", "train.keep_checkpoints": "3",
    "tensor.sequence_parallel": "true", "train.log_every": "2", "train.skip_nonfinite": "true", "train.remat": "full",
    "train.vocab_chunks": "2", "train.mlp_chunks": "2", "eval.windows": "4", "sharding.replicate": "embed",
    "data": "some/dir", "tokenizer": "bpe", "precision": "fp32", "seed": "9", "init": "",  # init: checked below
    "init_state": "some/state",
    "out": "runs/x", "resume": "true", "plan": "auto", "dry_run": "true", "device_peak_flops": "1e12",
    "progress": "none", "log.wandb": "false", "log.wandb_project": "p", "log.wandb_mode": "online",
}


def jaxpar_keys() -> set[str]:
    """Every key `jaxpar train` accepts, from the dataclasses (`model` is the preset key)."""
    keys = {"model"}
    for f in dataclasses.fields(C.Config):
        if f.name in C.SECTIONS:
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(C.SECTIONS[f.name])}
        elif f.name != "model_name":  # set by `model=`, not a key (apply_overrides rejects it)
            keys.add(f.name)
    return keys


def test_every_jaxpar_key_has_a_torchref_policy():
    keys = jaxpar_keys()
    assert {"train.grad_accum", "model.n_head", "mesh.pipe", "seed", "model"} <= keys and len(keys) > 40
    assert sorted(keys - set(KEY_POLICY)) == [], "jaxpar keys torchref neither mirrors nor rejects"
    assert sorted(set(KEY_POLICY) - keys) == [], "KEY_POLICY names keys jaxpar does not have"
    assert {kind for kind, _ in KEY_POLICY.values()} == KINDS
    assert all(len(why) >= 8 for _, why in KEY_POLICY.values())
    assert set(SAMPLE) == keys


def test_issue_keys_change_math_and_none_is_no_math():
    """The issue's list of math keys (all of train.*, model.*, precision, seed, init, data, tokenizer)
    may only be mirrored, same-math or rejected, except the train keys that only log or save."""
    output_only = {"train.eval_every", "train.eval_batches", "train.ckpt_every", "train.ckpt_minutes",
                   "train.keep_checkpoints", "train.log_every"}
    math = {k for k in jaxpar_keys() if k.split(".")[0] in ("train", "model")} | {
        "precision", "seed", "init", "data", "tokenizer"}
    assert {k for k in math if KEY_POLICY[k][0] == "no-math"} == output_only
    assert KEY_POLICY["train.grad_accum"][0] == "mirrored"


@pytest.mark.parametrize("key", sorted(k for k, (kind, _) in KEY_POLICY.items() if kind == "rejected"))
def test_rejected_keys_fail_with_one_line(key):
    with pytest.raises(ConfigError) as e:
        resolve_ref(TINY + [f"{key}={SAMPLE[key]}"])
    msg = str(e.value)
    assert msg == f"{key}={SAMPLE[key]} is not supported by torchref ({KEY_POLICY[key][1]})"
    assert "\n" not in msg


def _get(c, key):
    head, _, rest = key.partition(".")
    return getattr(getattr(c, head), rest) if rest else getattr(c, "model_name" if key == "model" else key)


@pytest.mark.parametrize("key", sorted(HELD - {"init", "precision"}))
def test_held_keys_reach_the_workers(key):
    """A key torchref holds is carried into the RunConfig the workers get (Job serialises it),
    with the value jaxpar resolves for it."""
    from torchref.runtime import Job

    cfg, ref = resolve_ref(TINY + [f"{key}={SAMPLE[key]}"])
    job = Job.from_json(Job(cfg, ref, "d", "i", "o").to_json())
    assert job.cfg == cfg
    assert _get(job.cfg, key) == _get(C.resolve(TINY + [f"{key}={SAMPLE[key]}"]), key) != _get(C.resolve(TINY), key)


@pytest.mark.parametrize("key", sorted(k for k in IGNORED if KEY_POLICY[k][0] != "rejected"))
def test_ignored_keys_are_accepted_and_change_nothing(key):
    assert KEY_POLICY[key][0] in ("same-math", "no-math")
    assert resolve_ref(TINY + [f"{key}={SAMPLE[key]}"]) == resolve_ref(TINY)
    if IGNORED[key][0] in (int, float, bool):  # parsed to the key's type: a malformed value is jaxpar's error
        with pytest.raises(ConfigError) as e:
            resolve_ref(TINY + [f"{key}=[1,x"])
        with pytest.raises(ConfigError) as want:
            C.resolve(TINY + [f"{key}=[1,x"])
        assert str(e.value) == str(want.value)


def test_held_and_ignored_keys_split_the_policy():
    assert HELD | set(IGNORED) == set(KEY_POLICY) and not HELD & set(IGNORED)
    assert {k for k in HELD if KEY_POLICY[k][0] != "mirrored"} == {"out", "train.log_every"}  # used for output
    assert {k for k, (kind, _) in KEY_POLICY.items() if kind == "mirrored"} <= HELD
    held_fields = {f"train.{f.name}" for f in dataclasses.fields(TrainSettings)}
    assert held_fields == {k for k in HELD if k.startswith("train.")}


def test_torchref_defaults_and_types_are_jaxpars():
    jax_cfg, ref_cfg = C.Config(), RunConfig()
    for key in HELD - {"precision"}:  # precision: the strategy's (fp32 for `single`)
        assert _get(ref_cfg, key) == _get(jax_cfg, key), key
    assert type(ref_cfg.model) is type(jax_cfg.model)  # one GPT-2 shape, gpt2common.model.ModelConfig
    for key, (tp, default) in IGNORED.items():
        head, _, rest = key.partition(".")
        types = C.field_types(C.SECTIONS[head] if rest else C.Config)
        assert (tp, default) == (types[rest or key], _get(jax_cfg, key)), key


# Invalid values of held keys: torchref re-states jaxpar's checks, so the first error must be the same line.
BAD = ["model.n_layer=0", "model.n_embd=130", "model.n_head=-1", "model.vocab_size=70000", "model.n_positions=16",
       "train.steps=0", "train.batch_size=0", "train.seq_len=-2", "train.grad_accum=0", "train.warmup_steps=-1",
       "train.lr=0", "train.beta1=1", "train.beta2=-0.1", "train.min_lr_ratio=1.5", "train.eps=-1",
       "train.weight_decay=-0.1", "train.grad_clip=-1", "train.log_every=-1", "seed=-1", "seed=4294967296",
       "train.grad_accum=3", "model=gpt3", "train.steps=x", "seed=1.5", "model.layer_norm_epsilon=nan", "model.layer_norm_epsilon=-1",
       "model.layer_norm_epsilon=0", "trian.steps=1",
       "train.bogus=1", "bogus=1", "model.bogus=1", "mesh.bogus=1", "pipeline.bogus=1", "eval.bogus=1",
       "sharding.bogus=1", "bogus.x=1"]


@pytest.mark.parametrize("arg", BAD)
def test_invalid_held_values_give_jaxpars_error(arg):
    with pytest.raises(ConfigError) as want:
        C.resolve(TINY + [arg])
    with pytest.raises(ConfigError) as got:
        resolve_ref(TINY + [arg])
    assert str(got.value) == str(want.value)


def test_precision_and_init_policies(tmp_path):
    from gpt2common.init import init_params
    from jaxpar.run.rundir import resolve_train

    cfg, _ = resolve_ref(TINY + ["precision=fp32"])
    assert cfg.precision == "fp32"
    cfg, _ = resolve_ref(TINY + ["strategy=distributed-ps-amp", "workers=2", "precision=bf16"])
    assert cfg.precision == "bf16"
    hf.save_hf(str(tmp_path / "hf"), C.PRESETS["gpt2-tiny"], init_params(C.PRESETS["gpt2-tiny"], 0))
    cfg, _ = resolve_ref(TINY + [f"init={tmp_path / 'hf'}"])  # model=gpt2-tiny agrees with the weights
    assert cfg.init == str(tmp_path / "hf")
    # model keys beside an init= that is no HF dir: the weights cannot be compared, in both
    with pytest.raises(ConfigError) as want:
        resolve_train(C.parse_kv(TINY + ["init=some/hf_dir"]), None)
    with pytest.raises(ConfigError) as got:
        resolve_ref(TINY + ["init=some/hf_dir"])
    assert str(got.value) == str(want.value) == (
        f"init='some/hf_dir' is no dir, nor a model in the local HF cache ({hf.hub_cache_dir()}); jaxpar never "
        "downloads: fetch it first (huggingface-cli download some/hf_dir)")


# Mirrored / same-math keys the property test does not draw, and where they are checked instead.
CHECKED_ELSEWHERE = {
    "model": "every drawn example starts from model=gpt2-tiny and overrides each shape key",
    "tokenizer": "examples read prepared token dirs; raw text goes through gpt2common.data in both (test_data.py)",
    "precision": "fp32 here; the bf16 rows of the matrix (parity_tests/matrix.py)",
    "init": "test_property_parity.test_default_train_settings_from_one_hf_init and every matrix row",
    "init_state": "both directions of the training-state handoff in test_state_handoff.py",
    "pipeline.gather": "torchref has no pipeline; gather=layer vs one device in tests/parallel/test_pipeline.py",
}


def test_mirrored_and_same_math_keys_are_drawn_by_the_property_test():
    from parity_tests.property import DRAWN_KEYS

    need = {k for k, (kind, _) in KEY_POLICY.items() if kind in ("mirrored", "same-math")}
    assert sorted(need - DRAWN_KEYS) == sorted(CHECKED_ELSEWHERE)
    assert DRAWN_KEYS <= set(KEY_POLICY)


@pytest.mark.parametrize("keys", [["model.n_layer=4"], ["model=gpt2"], ["model.n_embd=256"], ["train.seq_len=512"]])
def test_init_weights_set_the_model_in_both_with_the_same_error(tmp_path, capsys, keys):
    """torchref train init=<HF dir> model.n_layer=4 trained the dir's 2 layers without a word, and
    with the default train.seq_len=256 beside weights of n_positions=128 a worker died of an
    IndexError in the position embedding. Both CLIs now print the same line, nothing written."""
    from gpt2common.init import init_params
    from jaxpar import cli as jaxpar_cli
    from torchref import cli as torchref_cli

    mc = dataclasses.replace(C.PRESETS["gpt2-tiny"], n_positions=128)
    hf.save_hf(str(tmp_path / "hf"), mc, init_params(mc, 0))
    args = [f"init={tmp_path / 'hf'}", *keys, "train.steps=1"]
    assert jaxpar_cli.main(["train", *args, f"out={tmp_path / 'j'}"]) == 2
    want = capsys.readouterr().err
    assert want.startswith("error: ") and want.count("\n") == 1
    assert torchref_cli.main(["train", "strategy=single", *args, f"out={tmp_path / 't'}"]) == 2
    assert capsys.readouterr().err == want
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_init_by_a_cached_hub_name_and_a_missing_init_in_both(tmp_path, monkeypatch, capsys):
    """init=org/name resolves to the local HF cache's snapshot in torchref as in jaxpar (torchref
    read the model from `org/name` as a dir and refused it), and a name that is neither is the
    same line from both CLIs, naming the key."""
    import huggingface_hub.constants

    from gpt2common.init import init_params
    from jaxpar import cli as jaxpar_cli
    from torchref import cli as torchref_cli
    from torchref.launch import prepare

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "hub" / "models--someorg--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    mc = dataclasses.replace(C.PRESETS["gpt2-tiny"], n_positions=128)
    hf.save_hf(str(repo / "snapshots" / ("0" * 40)), mc, init_params(mc, 0))
    job = prepare(*resolve_ref(["strategy=single", "init=someorg/tiny-gpt2", "train.seq_len=32", "out=t"]))
    assert job.cfg.model == mc
    for cli, extra in ((jaxpar_cli, []), (torchref_cli, ["strategy=single"])):
        assert cli.main(["train", *extra, "init=someorg/not-cached", "out=none"]) == 2
        assert capsys.readouterr().err == (
            f"error: init='someorg/not-cached' is no dir, nor a model in the local HF cache ({hf.hub_cache_dir()}); "
            "jaxpar never downloads: fetch it first (huggingface-cli download someorg/not-cached)\n")
    assert not (tmp_path / "none").exists()
