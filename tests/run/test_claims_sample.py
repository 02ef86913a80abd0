"""`jaxpar sample`: temperature and top_k draw from the softmax distribution they promise.

References: the closed form p_i = exp(l_i/τ) / Σ_{j in top k} exp(l_j/τ) (0 outside the top k),
against the frequencies of 40,000 draws with fixed keys; and HF transformers' logits for the
end-to-end decode of a tiny model (top_k=1 is greedy; every token of a top_k=3 decode is among
HF's 3 largest logits at its position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import Config, ModelConfig
from jaxpar.models import gpt2
from jaxpar.run.sample import generate, sample_token

DRAWS = 40_000
LOGITS = np.array([2.0, 1.5, 1.4, 0.3, -0.2, 3.1, 0.0, -1.0, 2.2, 0.9, 1.0, -3.0], np.float32)


def frequencies(temperature: float, top_k: int) -> np.ndarray:
    keys = jax.random.split(jax.random.PRNGKey(0), DRAWS)
    ids = jax.vmap(lambda k: sample_token(jnp.asarray(LOGITS), temperature, top_k, k))(keys)
    return np.bincount(np.asarray(ids), minlength=len(LOGITS)) / DRAWS


def closed_form(temperature: float, top_k: int) -> np.ndarray:
    z = np.exp((LOGITS.astype(np.float64) - LOGITS.max()) / temperature)
    if top_k > 0:
        z[np.argsort(-LOGITS)[top_k:]] = 0.0
    return z / z.sum()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 5), (0.8, 3)])
def test_draws_follow_the_tempered_top_k_softmax(temperature, top_k):
    """Reference: closed form (module docstring); 5 binomial standard deviations per token."""
    p, f = closed_form(temperature, top_k), frequencies(temperature, top_k)
    sd = np.sqrt(p * (1 - p) / DRAWS)
    assert np.all(np.abs(f - p) <= 5 * sd + 1e-12), np.c_[p, f]
    assert np.all(f[p == 0] == 0)  # nothing outside the top k, ever
    assert np.all(f[p * DRAWS > 20] > 0)  # every token with an expected count > 20 was drawn


def test_a_vanishing_temperature_is_argmax():
    """logits / 1e-45 overflow fp32 (the draw was garbage): the limit of the tempered softmax as
    t -> 0 is the argmax, index 5, for any key."""
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    for t in (1e-45, 1e-38, 1e-20):
        assert set(np.asarray(jax.vmap(lambda k: sample_token(jnp.asarray(LOGITS), t, 0, k))(keys)).tolist()) == {5}


def test_temperature_zero_is_argmax():
    """Reference: hand-picked argmax of LOGITS (index 5)."""
    assert int(sample_token(jnp.asarray(LOGITS), 0.0, 40, None)) == 5


def test_decode_against_hf_transformers():
    """Reference: HF transformers GPT2LMHeadModel on the same weights."""
    import torch
    from support.claims_helpers import hf_model

    mc = ModelConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    params = gpt2.init_params(mc, 0)
    model = hf_model(mc, params)
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    cfg = Config(model=mc)
    greedy = generate(cfg, params, prompt, 8, 0.8, 1, seed=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy.tolist() == ids
    top3 = generate(cfg, params, prompt, 8, 1.5, 3, seed=1)
    with torch.no_grad():
        logits = model(torch.tensor([top3.tolist()])).logits[0].numpy()  # (13, 64), causal
    for pos in range(len(prompt), len(top3)):
        assert top3[pos] in np.argsort(-logits[pos - 1])[:3], pos
    assert top3.tolist() != greedy.tolist()  # τ=1.5 over 3 tokens does not reduce to greedy here


def test_decode_past_n_positions_conditions_on_the_last_window():
    """Reference: HF transformers, greedy, each step fed the last n_positions ids (nanoGPT's
    `idx[:, -block_size:]`). 5 prompt + 12 new ids with n_positions = 8: from the 4th new id on,
    the window slides past the prompt's start. Matrices scaled to std 0.5: at GPT-2's init std
    (0.02) a tiny model greedily repeats its last token whatever the window holds."""
    import torch
    from support.claims_helpers import hf_model

    mc = ModelConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=8)
    params = jax.tree.map(lambda a: a * 25 if a.ndim >= 2 else a, gpt2.init_params(mc, 1))
    model = hf_model(mc, params)
    ids = [3, 1, 4, 1, 5]
    got = generate(Config(model=mc), params, np.array(ids, np.int32), 12, 0.8, 1, seed=0)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-8:]])).logits[0, -1].argmax()))
    assert got.tolist() == ids
    assert len(set(ids[8:])) >= 4  # the reference itself depends on its window


def test_each_token_gets_a_fresh_key():
    """wte = 0 makes every logit 0: each position is a uniform draw over the 64 ids. 40 draws
    with fresh keys give ~30 distinct ids (fewer than 15 has probability < 1e-12); one key reused
    at every position draws one id 40 times. Reference: the uniform distribution."""
    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=64)
    params = gpt2.init_params(mc, 0)
    params = {**params, "wte": {"weight": jnp.zeros_like(params["wte"]["weight"])}}
    out = generate(Config(model=mc), params, np.array([1], np.int32), 40, 1.0, 0, seed=0)
    assert len(set(out[1:].tolist())) >= 15, out


def test_sample_on_an_fsdp_mesh_equals_one_device(tmp_path, capsys):
    """`jaxpar sample ... mesh.fsdp=2` gives each fsdp shard a row of its own and decodes what one
    device decodes (greedy, fp32). Reference: the one-device decode of the same checkpoint."""
    from support.cli_helpers import run

    from gpt2common import data, hf
    from jaxpar import cli

    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=256)
    hf.save_hf(str(tmp_path / "hf"), mc, gpt2.init_params(mc, 0))
    ckpt = tmp_path / "run"
    assert cli.main(["convert", f"hf={tmp_path / 'hf'}", f"out={ckpt}"]) == 0  # a checkpoint without training
    data.prepare("a byte tokenizer for sample " * 20, str(ckpt / "data"), "byte")  # what train would leave there
    args = ["sample", f"checkpoint={ckpt}", "prompt=ab", "max_new_tokens=6", "top_k=1"]
    capsys.readouterr()
    assert cli.main(args) == 0
    one = capsys.readouterr().out
    r = run([*args, "mesh.fsdp=2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == one and one.startswith("ab") and len(one.rstrip("\n")) > 2


def _converted_run(tmp_path, vocab: int, tokenizer_vocab: int | None, nan_at: int | None = None, n_positions: int = 64):
    """An HF dir (tiny model, and GPT-2 tokenizer files when tokenizer_vocab is set) converted into a
    run; nan_at: that element of the final layer norm's bias is NaN."""
    from tokenizers import ByteLevelBPETokenizer

    from gpt2common import hf
    from jaxpar import cli

    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=n_positions)
    params = gpt2.init_params(mc, 0)
    if nan_at is not None:
        params["ln_f"]["bias"][nan_at] = np.nan
    hf.save_hf(str(tmp_path / "hf"), mc, params)
    if tokenizer_vocab:
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(["to be or not to be, that is the question " * 50], vocab_size=tokenizer_vocab,
                                min_frequency=2, show_progress=False)
        tok.save_model(str(tmp_path / "hf"))  # vocab.json + merges.txt, as in an HF GPT-2 dir
    assert cli.main(["convert", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}"]) == 0
    return tmp_path / "run"


def test_sample_a_converted_run_with_the_hf_dirs_tokenizer(tmp_path, capsys):
    """`jaxpar convert hf=DIR out=RUN` then `jaxpar sample checkpoint=RUN`: a converted run has no
    prepared data, so sample encodes with DIR's vocab.json + merges.txt (it used to stop with
    "cannot find the tokenizer"). The greedy decode starts with the prompt, token for token, and
    passes the context: the CLI's window is n_positions (16), here unlike the vocab (512; gpt2-tiny
    has 256 of both); it equals the library's generate, whose window
    test_decode_past_n_positions_conditions_on_the_last_window checks against HF."""
    from gpt2common import data
    from jaxpar import cli

    run = _converted_run(tmp_path, 512, 300, n_positions=16)
    capsys.readouterr()
    assert cli.main(["sample", f"checkpoint={run}", "prompt=to be or", "max_new_tokens=16", "top_k=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("to be or") and len(out.rstrip("\n")) > len("to be or")
    tok = data.load_gpt2_tokenizer_dir(str(tmp_path / "hf"))
    prompt = tok.encode("to be or")
    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=512, n_positions=16)
    want = generate(Config(model=mc), gpt2.init_params(mc, 0), prompt, 16, 1.0, 1, seed=0)
    assert len(want) > mc.n_positions and out == tok.decode(want) + "\n"


def test_a_run_converted_from_a_relative_hf_dir_samples_from_another_directory(tmp_path, monkeypatch, capsys):
    """convert hf=hf recorded init='hf' as typed: sample from any other directory could not find
    the tokenizer files there. It records the absolute path."""
    import json

    from jaxpar import cli

    _converted_run(tmp_path / "first", 512, 300)
    monkeypatch.chdir(tmp_path / "first")
    assert cli.main(["convert", "hf=hf", "out=again"]) == 0
    assert json.loads((tmp_path / "first" / "again" / "config.json").read_text())["init"] == str(tmp_path / "first" / "hf")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["sample", "checkpoint=first/again", "prompt=to be or", "max_new_tokens=2", "top_k=1"]) == 0
    assert capsys.readouterr().out.startswith("to be or")


def test_sample_of_weights_with_a_nan_is_one_error_line(tmp_path, capsys):
    """NaN logits used to print the prompt and then token 0 max_new_tokens times, exit 0."""
    from gpt2common import data
    from jaxpar import cli

    run = _converted_run(tmp_path, 512, 300, nan_at=3)
    last = len(data.load_gpt2_tokenizer_dir(str(tmp_path / "hf")).encode("to be or")) - 1
    capsys.readouterr()
    assert cli.main(["sample", f"checkpoint={run}", "prompt=to be or", "max_new_tokens=5"]) == 2
    assert capsys.readouterr() == ("", f"error: checkpoint={str(run)!r}: the logits at position {last} are not "
                                       "finite: the weights are not usable\n")


def test_a_prompt_with_undecodable_bytes(tmp_path, capsys):
    """argv carries a byte that is not UTF-8 as a surrogate (it was a UnicodeEncodeError
    traceback): the BPE tokenizer gets U+FFFD and says so in one warning line."""
    from jaxpar import cli

    run = _converted_run(tmp_path, 512, 300)
    capsys.readouterr()
    assert cli.main(["sample", f"checkpoint={run}", "prompt=to be \udcff", "max_new_tokens=2", "top_k=1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("to be \ufffd")
    assert err == ("warning: prompt is not valid UTF-8 (1 undecodable sequences replaced by U+FFFD); "
                   "tokenizer=byte would keep the raw bytes\n")


@pytest.mark.parametrize("arg,msg", [("max_new_tokens=0", "max_new_tokens=0 must be positive"),
                                     ("max_new_tokens=-3", "max_new_tokens=-3 must be positive"),
                                     ("top_k=1.5", "top_k='1.5' is not an integer"),
                                     ("temperature=nan", "temperature='nan' is not a finite number"),
                                     ("seed=4294967296", "seed=4294967296 must be in [0, 2**32)")])
def test_sample_bad_options_are_one_line_before_any_output(tmp_path, capsys, arg, msg):
    from jaxpar import cli

    run = _converted_run(tmp_path, 512, 300)
    capsys.readouterr()
    assert cli.main(["sample", f"checkpoint={run}", "prompt=to be", arg]) == 2
    assert capsys.readouterr() == ("", f"error: {msg}\n")


@pytest.mark.parametrize("model_vocab,tokenizer_vocab,msg", [
    (512, None, "cannot find the tokenizer (no prepared data in {run}/data, and init='{hf}' holds no vocab.json + "
                "merges.txt)"),
    (256, 300, "the tokenizer in {hf} has {n} tokens, more than model.vocab_size=256"),
])
def test_sample_a_converted_run_without_a_usable_tokenizer_is_one_line(tmp_path, capsys, model_vocab,
                                                                         tokenizer_vocab, msg):
    from gpt2common import data
    from jaxpar import cli

    run = _converted_run(tmp_path, model_vocab, tokenizer_vocab)
    n = data.load_gpt2_tokenizer_dir(str(tmp_path / "hf")).vocab_size if tokenizer_vocab else 0
    assert tokenizer_vocab is None or 256 < n <= 300  # 256 byte tokens + merges
    capsys.readouterr()
    assert cli.main(["sample", f"checkpoint={run}", "prompt=to be"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: checkpoint={str(run)!r}: " + msg.format(run=run, hf=tmp_path / "hf", n=n) + "\n"
