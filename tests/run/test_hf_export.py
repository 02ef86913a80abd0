"""`jaxpar convert checkpoint=<run> to_hf=<dir>` writes a directory transformers uses as is: the
weights, the run's own tokenizer (AutoTokenizer) and generation_config.json, with the file
modes the umask gives (as save_pretrained's files have)."""

import contextlib
import io
import json
import os

import numpy as np
import pytest

from gpt2common import data as data_lib
from gpt2common import hf
from gpt2common.hf_tokenizer import save_tokenizer
from gpt2common.init import init_params
from gpt2common.model import ModelConfig
from jaxpar import cli

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

PANGRAM = "The quick brown fox jumps over the lazy dog.\n"


def _umask(mask):
    @contextlib.contextmanager
    def ctx():
        old = os.umask(mask)
        try:
            yield
        finally:
            os.umask(old)
    return ctx()


def test_byte_tokenizer_round_trips_every_byte(tmp_path):
    save_tokenizer(str(tmp_path), data_lib.Tokenizer("byte"), 256)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = data_lib.Tokenizer("byte")
    assert len(set(tok.convert_ids_to_tokens(list(range(256))))) == 256 and len(tok) == 256
    every = bytes(range(256)).decode("latin-1") + "ROMEO: \u2603\n"  # all 256 code points below U+0100, and more
    assert tok(every).input_ids == ours.encode(every).tolist() == list(every.encode("utf-8"))
    assert tok.decode(tok(every).input_ids) == every
    # each byte alone, and random byte strings (invalid UTF-8 included), decode as jaxpar decodes them
    assert [tok.decode([b]) for b in range(256)] == [ours.decode([b]) for b in range(256)]
    rng = np.random.default_rng(0)
    for ids in (rng.integers(0, 256, n).tolist() for n in rng.integers(1, 24, 300)):
        assert tok.decode(ids) == ours.decode(ids), ids


def test_export_of_a_trained_byte_run_generates_what_jaxpar_sample_generates(tmp_path):
    (tmp_path / "fox.txt").write_text(PANGRAM * 300)
    run, out = tmp_path / "run", tmp_path / "hf"
    assert cli.main(["train", "model=gpt2-tiny", f"data={tmp_path / 'fox.txt'}", "train.steps=60", "train.batch_size=4",
                     "train.seq_len=32", "train.lr=3e-3", "train.warmup_steps=5", "train.eval_every=0",
                     "precision=fp32", "progress=none", "seed=1", f"out={run}"]) == 0
    with _umask(0o027):
        assert cli.main(["convert", f"checkpoint={run}", f"to_hf={out}"]) == 0
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == names
    assert {n: oct(os.stat(out / n).st_mode & 0o777) for n in names} == dict.fromkeys(names, "0o640")
    gen = transformers.GenerationConfig.from_pretrained(out)  # jaxpar sample's defaults
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.max_new_tokens, gen.eos_token_id) == (True, 0.8, 40, 100, 255)

    n, prompt = 48, "ROMEO:"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["sample", f"checkpoint={run}", f"prompt={prompt}", "temperature=0", f"max_new_tokens={n}"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(prompt.encode())
    with torch.no_grad():
        got = model.generate(ids, do_sample=False, max_new_tokens=n)[0].tolist()
    assert len(got) == len(prompt) + n
    text = tok.decode(got)
    assert printed.getvalue() == text + "\n"
    assert tok(text).input_ids == got  # token for token (the text is ASCII: nothing was replaced)
    assert len(set(got[len(prompt):])) >= 8  # a learnt continuation, not one repeated byte
    assert "over the lazy dog." in text  # it learnt the text


def test_export_of_a_gpt2_tokenizer_run_carries_its_vocab_and_merges(tmp_path):
    """A run converted from an HF dir with GPT-2 tokenizer files: the export has those files
    byte for byte, plus a tokenizer.json that AutoTokenizer reads, giving jaxpar's ids, with
    <|endoftext|> as bos/eos as in GPT-2's own dir."""
    from tokenizers import ByteLevelBPETokenizer

    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    src.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([PANGRAM * 50], vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(src))
    mc = ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=bpe.get_vocab_size(), n_positions=64)
    hf.save_hf(str(src), mc, init_params(mc, seed=0))
    assert cli.main(["convert", f"hf={src}", f"out={run}"]) == 0
    assert cli.main(["convert", f"checkpoint={run}", f"to_hf={out}"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    for name in ("vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = data_lib.load_gpt2_tokenizer_dir(str(src))
    text = "The lazy dog jumps over the quick brown fox. Zebra!"
    assert tok(text).input_ids == ours.encode(text).tolist() and len(ours.encode(text)) < len(text)
    assert tok.decode(tok(text).input_ids) == ours.decode(ours.encode(text)) == text
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 0)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == mc.vocab_size
    # The tokenizer's length limit is the context, n_positions = 64, not the vocabulary (~300 here;
    # gpt2-tiny has 256 of both, so only a shape where they differ tells the two fields apart):
    # truncation cuts a text longer than both at the 64 positions the model has.
    assert mc.vocab_size != mc.n_positions and tok.model_max_length == 64
    long_text = PANGRAM * 40
    assert len(ours.encode(long_text)) > mc.vocab_size
    assert tok(long_text, truncation=True).input_ids == ours.encode(long_text).tolist()[:64]


def test_prepared_bpe_tokenizer_is_exported_as_the_run_used_it(tmp_path):
    """tokenizer=bpe (trained by prepare, with <|endoftext|> to end documents): the prepared dir's
    tokenizer.json goes along, and <|endoftext|> is its eos token (GPT-2's convention)."""
    meta = data_lib.prepare(PANGRAM * 40, str(tmp_path / "data"), "bpe")
    ours = data_lib.load_tokenizer(str(tmp_path / "data"))
    (tmp_path / "hf").mkdir()
    save_tokenizer(str(tmp_path / "hf"), ours, 64)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert len(tok) == meta["vocab_size"] == ours.vocab_size
    ids = ours.encode(PANGRAM * 2).tolist()
    assert tok(PANGRAM * 2).input_ids == ids and tok.decode(ids) == PANGRAM * 2
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == ours.hf_tokenizer().token_to_id("<|endoftext|>")


def test_a_run_without_a_tokenizer_exports_the_model_and_says_so(tmp_path, capsys):
    mc = ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=40, n_positions=16)
    hf.save_hf(str(tmp_path / "src"), mc, init_params(mc, seed=0))
    assert cli.main(["convert", f"hf={tmp_path / 'src'}", f"out={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", f"checkpoint={tmp_path / 'run'}", f"to_hf={tmp_path / 'hf'}"]) == 0
    assert capsys.readouterr().err == (f"warning: checkpoint={str(tmp_path / 'run')!r} names no tokenizer (no prepared "
                                       f"data, no vocab.json + merges.txt in init=): {tmp_path / 'hf'} holds the "
                                       "model only\n")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_text_tokenized_by_the_run_with_a_gpt2_dir_names_that_dir_as_the_source(tmp_path):
    """train data=<text> tokenizer=<GPT-2 dir>: the run's prepared data holds tokenizer.json, and the
    dir it came from is where vocab.json and merges.txt are copied from."""
    from tokenizers import ByteLevelBPETokenizer

    from jaxpar import config as C
    from jaxpar.run.sample import tokenizer_source

    src = tmp_path / "tok"
    src.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([PANGRAM * 50], vocab_size=300, min_frequency=2, show_progress=False)
    bpe.save_model(str(src))
    data_lib.prepare(PANGRAM * 40, str(tmp_path / "run" / "data"), str(src))
    tok, source = tokenizer_source(str(tmp_path / "run"), C.Config(tokenizer=str(src)))
    assert (tok.kind, source) == ("gpt2-dir", str(src))
    tok, source = tokenizer_source(str(tmp_path / "run"), C.Config())  # prepared elsewhere: tokenizer.json only
    assert (tok.kind, source) == ("gpt2-dir", "")
