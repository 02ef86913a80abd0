"""The HF weight format (gpt2common/hf.py) on its own, no JAX, no torch: a save_pretrained dir
written by `save_hf` reads back as the same model shape and the same arrays, and a weight
whose shape is not HF's is refused by name even when its size matches.

Independent reference: the numpy arrays written, compared bit for bit, and HF GPT2Config's
field names written down here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gpt2common import hf
from gpt2common.grammar import ConfigError
from gpt2common.init import init_params
from gpt2common.model import ModelConfig

# Every shape field off its default, layer_norm_epsilon included (GPT2Config.layer_norm_epsilon).
MC = ModelConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=12, layer_norm_epsilon=1e-6)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: np.asarray(v)})
    return out


def test_save_then_load_is_the_same_model(tmp_path):
    params = init_params(MC, seed=3)
    hf.save_hf(str(tmp_path), MC, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions",
                                    "layer_norm_epsilon")} == {"n_layer": 2, "n_embd": 16, "n_head": 2,
                                                               "vocab_size": 40, "n_positions": 12,
                                                               "layer_norm_epsilon": 1e-6}
    cfg, back = hf.load_hf(str(tmp_path))
    assert cfg == MC
    a, b = _flat(params), _flat(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and np.array_equal(a[k].astype(np.float32), b[k]), k


def test_a_transposed_weight_is_refused_by_name(tmp_path):
    """c_attn.weight is Conv1D's (in, out) = (16, 48); an (out, in) matrix has the same size."""
    hf.save_hf(str(tmp_path), MC, init_params(MC, seed=3))
    sd = load_file(str(tmp_path / hf.WEIGHTS))
    sd["transformer.h.1.attn.c_attn.weight"] = np.ascontiguousarray(sd["transformer.h.1.attn.c_attn.weight"].T)
    save_file(sd, str(tmp_path / hf.WEIGHTS))
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(tmp_path))
    assert str(e.value) == "HF weight 'h.1.attn.c_attn.weight' has shape (48, 16), expected (16, 48)"


def test_config_special_tokens_and_n_inner(tmp_path):
    """bos/eos are the last id, vocab_size - 1 (GPT-2's <|endoftext|> is 50256 of 50257), never one
    past the vocab. On import, n_inner may be null or state 4*n_embd (64 here) explicitly, as many HF
    dirs do; any other MLP width is refused. Reference: GPT2Config's fields, written down here."""
    hf.save_hf(str(tmp_path), MC, init_params(MC, seed=3))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["n_inner"]) == (39, 39, None)
    for n_inner in (64, 32):
        (tmp_path / "config.json").write_text(json.dumps({**written, "n_inner": n_inner}))
        if n_inner == 64:
            assert hf.load_hf(str(tmp_path))[0] == MC
            continue
        with pytest.raises(ConfigError) as e:
            hf.load_hf(str(tmp_path))
        assert str(e.value) == f"{str(tmp_path)!r}: only GPT-2 with gelu_new and n_inner=4*n_embd is supported"


def test_only_the_tanh_gelu_is_imported(tmp_path):
    """HF's "gelu" is the exact erf GELU, jaxpar and torchref run "gelu_new" (tanh): an HF dir with
    any other activation is refused, one without the field gets GPT2Config's default gelu_new."""
    hf.save_hf(str(tmp_path), MC, init_params(MC, seed=3))
    written = json.loads((tmp_path / "config.json").read_text())
    for act in ("gelu", "relu", None):
        c = {k: v for k, v in written.items() if k != "activation_function"}
        (tmp_path / "config.json").write_text(json.dumps(c if act is None else {**c, "activation_function": act}))
        if act is None:
            assert hf.load_hf(str(tmp_path))[0] == MC
            continue
        with pytest.raises(ConfigError) as e:
            hf.model_config_from_hf(str(tmp_path))
        assert str(e.value) == f"{str(tmp_path)!r}: only GPT-2 with gelu_new and n_inner=4*n_embd is supported"


def test_a_config_without_the_shape_fields_is_one_error(tmp_path):
    """A config.json that is not an object, or lacks (or misspells the type of) a shape field, is a
    ConfigError naming it (the CLIs' one `error:` line), not a KeyError / AttributeError traceback."""
    hf.save_hf(str(tmp_path), MC, init_params(MC, seed=3))
    written = json.loads((tmp_path / "config.json").read_text())
    cases = [([1, 2], "config.json is corrupt"),
             ({k: v for k, v in written.items() if k != "n_layer"}, "config.json has no positive integer n_layer (got None)"),
             ({**written, "n_head": "2"}, "config.json has no positive integer n_head (got '2')"),
             ({**written, "n_positions": 0}, "config.json has no positive integer n_positions (got 0)"),
             ({**written, "vocab_size": True}, "config.json has no positive integer vocab_size (got True)")]
    for doc, msg in cases:
        (tmp_path / "config.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigError) as e:
            hf.load_hf(str(tmp_path))
        assert str(e.value) == f"{str(tmp_path)!r}: {msg}"


def test_a_config_json_that_cannot_be_read_is_one_error(tmp_path):
    """init= / hf= naming a file, a config.json that is a directory or not UTF-8, a
    layer_norm_epsilon that is no positive number: a ConfigError naming the path, where each was
    a NotADirectoryError / IsADirectoryError / UnicodeDecodeError / ValueError traceback."""
    hf.save_hf(str(tmp_path / "hf"), MC, init_params(MC, seed=3))
    cfg_json = tmp_path / "hf" / "config.json"
    with pytest.raises(ConfigError) as e:
        hf.load_hf_config(str(cfg_json), "init")
    assert str(e.value) == f"init={str(cfg_json)!r} is not an HF save_pretrained dir (no config.json)"
    written = cfg_json.read_text()
    cfg_json.unlink()
    cfg_json.mkdir()
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(tmp_path / "hf"), "hf")
    assert str(e.value) == f"hf={str(tmp_path / 'hf')!r}: config.json cannot be read (Is a directory)"
    cfg_json.rmdir()
    cases = [(b"\xff\xfe{}", "config.json is corrupt"), (b"[" * 100_000 + b"]" * 100_000, "config.json is corrupt")]
    cases += [(json.dumps({**json.loads(written), "layer_norm_epsilon": eps}).encode(),
               f"config.json has no positive number layer_norm_epsilon (got {eps!r})") for eps in ("x", -1e-5, None)]
    for doc, msg in cases:
        cfg_json.write_bytes(doc)
        with pytest.raises(ConfigError) as e:
            hf.model_config_from_hf(str(tmp_path / "hf"))
        assert str(e.value) == f"{str(tmp_path / 'hf')!r}: {msg}"


def test_a_hub_name_loads_from_the_local_cache_only(tmp_path, monkeypatch):
    """`init=org/name` as transformers resolves it offline: the cache's refs/main names the
    snapshot dir holding the save. A name not in the cache keeps the dir error (no download)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # a relative dir named like the model must not exist here
    revision = "0" * 40
    repo = tmp_path / "hub" / "models--someorg--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    params = init_params(MC, seed=3)
    hf.save_hf(str(repo / "snapshots" / revision), MC, params)
    cfg, back = hf.load_hf("someorg/tiny-gpt2", "init")
    assert cfg == MC
    a, b = _flat(params), _flat(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[k].astype(np.float32), b[k]) for k in a)
    with pytest.raises(ConfigError) as e:
        hf.load_hf("someorg/not-cached", "init")
    assert str(e.value) == (f"init='someorg/not-cached' is no dir, nor a model in the local HF cache "
                            f"({hf.hub_cache_dir()}); jaxpar never downloads: fetch it first "
                            "(huggingface-cli download someorg/not-cached)")
    assert hf.cached_snapshot(".hidden") is None and hf.cached_snapshot("a/b/c") is None


def test_a_jaxpar_run_dir_given_as_an_hf_dir_is_named_as_one(tmp_path, capsys):
    """`train init=RUN` / `eval hf=RUN` with a jaxpar run dir said "model_type=None, expected
    'gpt2'". Both CLIs now name it a run dir and say what takes one; nothing is written."""
    from jaxpar import cli
    from jaxpar import config as C
    from torchref import launch
    from torchref.config import resolve_ref

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)  # what a run dir holds that load_hf_config looks at
    (run / "config.json").write_text(C.dumps(C.resolve(["model=gpt2-tiny"])))
    line = (f"init={str(run)!r} is a jaxpar run dir, not an HF save_pretrained dir: eval and sample take it as "
            f"checkpoint=, and `jaxpar convert checkpoint={run} to_hf=DIR` exports its weights")
    assert cli.main(["train", f"init={run}", f"out={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError) as e:  # torchref: checked before any process starts
        launch.train(*resolve_ref(["strategy=single", f"init={run}", f"out={tmp_path / 'ref'}"]))
    assert str(e.value) == line
    assert not (tmp_path / "ref").exists()
    with pytest.raises(ConfigError) as e:
        hf.load_hf_config(str(run), "hf")
    assert str(e.value) == "hf" + line[len("init"):]
    (run / "ckpt").rmdir()  # a config.json of keys alone is not taken for a run: the general line
    with pytest.raises(ConfigError) as e:
        hf.load_hf_config(str(run), "init")
    assert str(e.value) == f"init={str(run)!r}: model_type=None, expected 'gpt2'"
