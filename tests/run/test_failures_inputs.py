"""Inputs that used to end in a traceback, run out of memory or be taken silently, each now
one `error:` line naming the key or file (exit 2, nothing written) or handled: a file where a
folder belongs, a FIFO or device as data, a negative eval.windows, an out-of-range port, a
malformed JAXPAR_FAULT_SIGNAL, train.steps past the step counter, a metrics file torn by kill -9,
a stale JAXPAR_COORDINATOR. No training; in-process but for two CLI runs.

Independent reference: the messages and values written down by hand."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from gpt2common import data
from jaxpar import cli
from jaxpar import config as C
from jaxpar.config import ConfigError
from jaxpar.run import loop
from jaxpar.run.plot import plot_run


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    return err


def test_prepare_out_naming_a_file(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    assert cli.main(["prepare", f"out={f}"]) == 2
    assert one_line(capsys) == f"error: out={str(f)!r} exists and is not a directory\n"
    assert f.read_text() == "keep"


def test_a_fifo_or_device_is_named_for_what_it_is(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as e:
        data.prepare_input(str(fifo), tmp_path / "p")
    assert str(e.value) == f"input={str(fifo)!r} is not a regular file or folder"
    assert not (tmp_path / "p").exists()
    with pytest.raises(ConfigError) as e:
        data.load_tokens("/dev/null")
    assert str(e.value) == "data file '/dev/null' is not a regular file"
    with pytest.raises(ConfigError) as e:
        data.load_tokens(str(tmp_path / "nope.bin"))
    assert str(e.value) == f"data file {str(tmp_path / 'nope.bin')!r} does not exist"


def test_negative_eval_windows_names_the_key():
    with pytest.raises(ConfigError) as e:
        data.eval_windows(np.arange(100, dtype=np.uint16), 16, -1)
    assert str(e.value) == "eval.windows=-1 must be >= 0 (0: every window that fits)"
    assert data.eval_windows(np.arange(100, dtype=np.uint16), 16, 2)[0].shape == (2, 16)


@pytest.mark.parametrize("port,ok", [("99999", False), ("65536", False), ("-1", False), ("65535", True)])
def test_launch_port_range(port, ok):
    from jaxpar.run.launch import parse

    if ok:
        assert parse([f"port={port}", "nprocs=2", "--", "mesh"])[0]["port"] == int(port)
        return
    with pytest.raises(ConfigError) as e:
        parse([f"port={port}", "nprocs=2", "--", "mesh"])
    assert str(e.value) == f"launch: port={port} must be in 1..65535 (0 or none: a free one)"


@pytest.mark.parametrize("grace,msg", [("-1", "launch: grace=-1 must be >= 0"),
                                       ("inf", "launch: grace='inf' is not an integer"),
                                       ("nan", "launch: grace='nan' is not an integer")])
def test_launch_grace_is_a_non_negative_integer(grace, msg):
    """A negative grace was taken: a failed rank's peers got SIGKILL at once, with no time to exit."""
    from jaxpar.run.launch import parse

    assert parse(["grace=0", "nprocs=2", "--", "mesh"])[0]["grace"] == 0
    with pytest.raises(ConfigError) as e:
        parse([f"grace={grace}", "nprocs=2", "--", "mesh"])
    assert str(e.value) == msg


@pytest.mark.parametrize("spec", ["BOGUS", "SIGTERM@x", "SIGNOPE@2", "SIG_DFL@2", "SIGTERM@2@r", "SIGTERM@1@2@3"])
def test_a_malformed_fault_spec_is_one_line_before_any_write(tmp_path, capsys, monkeypatch, spec):
    monkeypatch.setenv("JAXPAR_FAULT_SIGNAL", spec)
    out = tmp_path / "o"
    assert cli.main(["train", "model=gpt2-tiny", "train.steps=1", f"out={out}"]) == 2
    assert one_line(capsys) == (f"error: JAXPAR_FAULT_SIGNAL={spec!r} must be <SIGNAL>@<step>[@<rank>], "
                                "e.g. SIGTERM@5\n")
    assert not out.exists()
    monkeypatch.setenv("JAXPAR_FAULT_SIGNAL", "SIGKILL@7@0")
    assert loop._fault_injection() == (7, 9)


def test_train_steps_past_the_step_counter_and_the_lr_table(monkeypatch):
    """train.steps=1e14 passed validation, then asked for a 400 TB learning-rate table."""
    with pytest.raises(ConfigError) as e:
        C.resolve(["model=gpt2-tiny", "train.steps=100000000000000"])
    assert str(e.value) == "train.steps=100000000000000 must be < 2**31"
    assert C.resolve(["model=gpt2-tiny", f"train.steps={2**31 - 1}"]).train.steps == 2**31 - 1
    from jaxpar.train import lr_schedule

    tc = C.resolve(["model=gpt2-tiny", "train.steps=10", "train.warmup_steps=3"]).train
    monkeypatch.setattr(loop._LrTable, "LR_CHUNK", 4)  # chunk edges at 4 and 8
    order = (9, 0, 3, 4, 7, 8, 5)
    a, b = loop._LrTable(lr_schedule(tc)), loop._LrTable(lr_schedule(tc))
    got = {i: a[i] for i in order}
    assert got == {i: b[i] for i in sorted(order)}  # bit for bit whatever the order (a resume reads from its step)
    want = {i: float(lr_schedule(tc)(jnp.int32(i))) for i in order}  # the schedule one step at a time
    assert all(abs(got[i] - want[i]) <= 4e-7 * want[i] for i in order), (got, want)  # fp32: an ulp or two


def test_plot_drops_a_line_torn_by_kill_9(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rec = {"step": 1, "loss": 5.0, "tokens_per_s": 10.0}
    (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2})[:17])
    assert plot_run(str(run)) == str(run / "curves.png")
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (run / "metrics.jsonl").write_text(json.dumps(rec)[:17] + "\n" + json.dumps(rec) + "\n")  # not the last: corrupt
    with pytest.raises(ConfigError) as e:
        plot_run(str(run))
    assert str(e.value) == f"{str(run / 'metrics.jsonl')!r} is corrupt"


TEXT = "the quick brown fox jumps over the lazy dog. " * 200


@pytest.fixture
def prepared(tmp_path):
    """A byte-tokenized and a BPE-tokenized prepared dir: (byte dir, bpe dir)."""
    data.prepare(TEXT, tmp_path / "byte", "byte")
    data.prepare(TEXT, tmp_path / "bpe", "bpe")
    return tmp_path / "byte", tmp_path / "bpe"


def _edit_meta(d, **changes):
    meta = json.loads((d / "meta.json").read_text())
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not None}
    (d / "meta.json").write_text(json.dumps(meta))


def _refused(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def test_token_ids_made_elsewhere_train_with_their_own_vocab(prepared):
    """A meta.json naming a tokenizer jaxpar does not make (nanoGPT's layout, the user's own
    tokenizer; the parity tests' random ids) is trusted for its vocab: no file to check it against."""
    byte, _ = prepared
    _edit_meta(byte, tokenizer="random", vocab_size=300)
    ds = data.Dataset.open(str(byte), 512, 16)
    assert data.read_meta(str(byte))["vocab_size"] == 300 and ds is not None
    assert _refused(data.Dataset.open, str(byte), 256, 16) == "data vocab_size=300 is larger than model.vocab_size=256"


def test_a_prepared_dir_whose_meta_json_lies(prepared):
    byte, bpe = prepared
    bpe_vocab = json.loads((bpe / "meta.json").read_text())["vocab_size"]
    _edit_meta(byte, tokenizer=None)
    assert _refused(data.Dataset.open, str(byte), 256, 16) == (
        f"data={str(byte)!r}: meta.json names no known tokenizer (tokenizer=None); prepare it again")
    _edit_meta(byte, tokenizer="byte", vocab_size=300)
    assert _refused(data.Dataset.open, str(byte), 512, 16) == (
        f"data={str(byte)!r}: meta.json says vocab_size=300 but its tokenizer has 256; prepare it again")
    _edit_meta(bpe, vocab_size=bpe_vocab - 1)
    assert _refused(data.load_tokenizer, str(bpe)) == (
        f"data={str(bpe)!r}: meta.json says vocab_size={bpe_vocab - 1} but its tokenizer has {bpe_vocab}; "
        "prepare it again")
    (bpe / "tokenizer.json").write_text("{broken")
    assert _refused(data.load_tokenizer, str(bpe)).startswith(f"data={str(bpe)!r}: tokenizer.json is corrupt (")
    (bpe / "tokenizer.json").unlink()
    assert _refused(data.load_tokenizer, str(bpe)) == (
        f"data={str(bpe)!r}: meta.json names tokenizer=bpe but tokenizer.json is missing; prepare it again")


def test_a_truncated_split_is_refused(prepared):
    byte, _ = prepared
    n = json.loads((byte / "meta.json").read_text())["train_tokens"]
    with open(byte / "train.bin", "r+b") as f:
        f.truncate(2 * (n - 10))
    assert _refused(data.Dataset.open, str(byte), 256, 16) == (
        f"train.bin in {str(byte)!r} has {n - 10} tokens but meta.json says {n} (truncated or replaced); "
        "prepare it again")


def test_a_corrupt_gpt2_tokenizer_dir(tmp_path):
    (tmp_path / "vocab.json").write_text("{not json")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    assert _refused(data.load_gpt2_tokenizer_dir, str(tmp_path)).startswith(
        f"tokenizer={str(tmp_path)!r}: vocab.json or merges.txt is corrupt (")


def test_an_out_path_that_is_not_utf8(tmp_path, capsys):
    """It passed every check, trained, then the first checkpoint failed with pages of tracebacks."""
    out = os.path.join(str(tmp_path), "run\udcff")  # the byte 0xff, as argv carries it
    assert cli.main(["train", "model=gpt2-tiny", "train.steps=1", f"out={out}"]) == 2
    assert one_line(capsys) == f"error: out={out!r} is not valid UTF-8; choose a path that is\n"
    assert os.listdir(tmp_path) == []


def test_launch_on_a_port_in_use(capsys):
    """Rank 0 died with exit 139 and no word about the port; now the launcher says so first."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["launch", "nprocs=2", f"port={port}", "--", "mesh", "mesh.data=2"]) == 2
    assert one_line(capsys) == (f"error: launch: port={port} cannot be used (Address already in use); choose "
                                "another or leave port= out for a free one\n")


def _hf_dir(path, mc, dtype=None):
    from safetensors.numpy import load_file, save_file

    from gpt2common import hf
    from jaxpar.models import gpt2

    hf.save_hf(str(path), mc, gpt2.init_params(mc, 0))
    if dtype is not None:  # as transformers' save_pretrained of a bf16 model writes it
        sd = load_file(str(path / "model.safetensors"))
        save_file({k: v.astype(dtype) for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_an_hf_dir_with_bf16_weights(tmp_path):
    """`eval hf=` read the weights before JAX (which registers numpy's bfloat16) was imported: a
    TypeError traceback. Now the bf16 values load exactly, in a process without JAX too."""
    import subprocess
    import sys

    import ml_dtypes
    from support.cli_helpers import clean_env, run

    from gpt2common import hf
    from gpt2common.model import ModelConfig

    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    _hf_dir(tmp_path / "bf16", mc, ml_dtypes.bfloat16)
    _, params = hf.load_hf(str(tmp_path / "bf16"))
    w = params["wte"]["weight"]
    assert w.dtype == np.float32 and np.array_equal(w, w.astype(ml_dtypes.bfloat16).astype(np.float32))
    code = "import sys; from gpt2common import hf; hf.load_hf(sys.argv[1]); print('jax' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bf16")], capture_output=True, text=True,
                       env=clean_env())
    assert (r.returncode, r.stdout) == (0, "False\n"), r.stderr
    (tmp_path / "tokens.bin").write_bytes((np.arange(200) % 64).astype("<u2").tobytes())
    r = run(["eval", f"hf={tmp_path / 'bf16'}", f"data={tmp_path / 'tokens.bin'}", "train.seq_len=16"], timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == 12 * 16, r.stderr


def test_an_hf_config_without_whole_heads(tmp_path):
    from gpt2common import hf
    from gpt2common.model import ModelConfig

    _hf_dir(tmp_path, ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_head": 3}))
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(tmp_path))
    assert str(e.value) == f"{str(tmp_path)!r}: config.json: model.n_embd=16 is not divisible by model.n_head=3"


def test_plot_out_is_checked_before_drawing(tmp_path):
    """out= naming a missing folder or a non-PNG file was a traceback; a folder got <folder>.png
    while the command printed the folder's name."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 10.0}) + "\n")
    for out, msg in ((tmp_path / "nope" / "x.png", f"folder {str(tmp_path / 'nope')!r} does not exist"),
                     (tmp_path / "x.txt", None)):
        with pytest.raises(ConfigError) as e:
            plot_run(str(run), str(out))
        assert str(e.value) == (f"out={str(out)!r}: {msg}" if msg else f"out={str(out)!r} must name a .png file or a folder")
    figs = tmp_path / "figs"
    figs.mkdir()
    assert plot_run(str(run), str(figs)) == str(figs / "curves.png")
    assert sorted(os.listdir(tmp_path)) == ["figs", "run"] and os.listdir(figs) == ["curves.png"]


def test_plot_out_given_empty_is_the_default(tmp_path):
    """`plot out=` is <run>/curves.png, as --help says of an empty out (it was refused as no .png)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 10.0}) + "\n")
    assert plot_run(str(run), "") == str(run / "curves.png")
    assert sorted(os.listdir(run)) == ["curves.png", "metrics.jsonl"]


def test_a_stale_coordinator_is_one_line(tmp_path):
    """JAXPAR_* left in the shell by another job: process 1 waited for a coordinator nobody runs,
    then JAX aborted with a C++ stack (exit 134)."""
    import subprocess
    import sys
    import time

    from support.cli_helpers import clean_env

    from jaxpar.run.launch import free_port

    address = f"127.0.0.1:{free_port()}"
    env = clean_env(JAXPAR_COORDINATOR=address, JAXPAR_NUM_PROCESSES="2", JAXPAR_PROCESS_ID="1",
                    JAXPAR_INIT_TIMEOUT="2")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", "mesh", "mesh.data=2"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert (r.returncode, r.stderr) == (3, f"error: could not join the multi-process job (nothing accepts "
                                           f"connections at JAXPAR_COORDINATOR={address} after 2 s; is it left "
                                           "over from another job?)\n")
    assert time.monotonic() - t0 < 60
