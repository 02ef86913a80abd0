"""Property-based parity (hypothesis): jaxpar and torchref agree step by step on configurations
drawn over the whole shared space (`parity_tests.property`: model shape, every optimizer and
schedule key, grad_accum, memory knobs, seed, a jaxpar mesh on 8 emulated devices, a synchronous
fp32 torchref strategy), within the fp32 trajectory bounds of `parity_tests/tolerances.py`.

Default run: a fixed-seed handful (`derandomize=True`: 2 drawn + 1 pinned). `python -m pytest -m slow parity_tests`:
>= 40 examples, Horovod included. A failing example is shrunk and reported with the commands
that reproduce it through the CLIs.
"""

import json
import os

import pytest
from hypothesis import example, given, note, settings

pytest.importorskip("torch")
pytest.importorskip("transformers")

from parity_tests import property as P  # noqa: E402

FAST_EXAMPLES = 2  # + PINNED


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("property"))


def test_default_train_settings_from_one_hf_init(root):
    """The issue's "done when": a jaxpar / torchref pair from one HF init with the DEFAULT train
    settings (B=8, T=256, lr 6e-4, warmup 100 > steps, cosine to 0.1, wd 0.1, clip 1.0), fp32,
    agrees step by step within 1e-5 relative loss. Before the schedule fix this pair differed by
    6e-2 at step 5 (torchref warmed up over 100 steps, jaxpar over min(100, steps))."""
    from parity_tests.common import TINY, write_data, write_init

    init = write_init(os.path.join(root, "hf_init_seed4"), TINY, seed=4)
    # As in OpenAI's GPT-2 config.json: dropout 0.1 in the HF dir. Both sides train with model.dropout
    # (default 0), not the dir's pdrop; inheriting it would make jaxpar drop units and torchref refuse.
    with open(os.path.join(init, "config.json")) as f:
        hf_cfg = json.load(f)
    hf_cfg.update(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    with open(os.path.join(init, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    common = [f"init={init}", f"data={write_data(os.path.join(root, 'data_byte'))}", "train.steps=5", "seed=4"]
    jx = P.JaxRuns.run(common + ["precision=fp32"], os.path.join(root, "jax_runs.log"))
    tr = P.run_torchref(common + ["strategy=single"], os.path.join(root, "torchref_default"))
    res = P.compare(jx, tr)
    assert res.get("steps") == 5, res
    assert res["max_loss_rel"] <= 1e-5, res
    assert res["max_grad_norm_rel"] <= P.BOUNDS["grad_rel"], res
    # lr(step 4) = 6e-4 * 4/5: the run trains, so the agreement is not that of two frozen models
    assert tr["losses"][0] - tr["losses"][-1] > 1e-2, res


def check(ex: P.Example, root: str) -> None:
    res = P.run_example(ex, root)
    note(f"result: {res}")
    assert res["pass"], f"jaxpar and torchref disagree: {res}\nreproduce:\n{ex.commands(root)}"


# Always run besides the drawn ones: tensor parallelism + grad_accum + DDP accumulation (no_sync)
# + tiny clip + chunked logits/MLP, which a 2-example fixed draw may miss.
PINNED = P.Example(
    common=("model=gpt2-tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.vocab_size=64",
            "model.n_positions=16", "model.layer_norm_epsilon=1e-05", "train.batch_size=8", "train.seq_len=8",
            "train.steps=4", "train.warmup_steps=2", "train.lr=0.002", "train.min_lr_ratio=0.1",
            "train.weight_decay=0.1", "train.beta1=0.9", "train.beta2=0.95", "train.eps=1e-08",
            "train.grad_clip=1e-06", "train.grad_accum=2", "seed=3"),
    vocab=64,
    jaxpar=("mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "mesh.pipe=1", "train.remat=selective",
            "train.vocab_chunks=2", "train.mlp_chunks=2"),
    torchref=("strategy=distributed-ps", "workers=2"))


@settings(max_examples=FAST_EXAMPLES, **P.SETTINGS)
@example(ex=PINNED)
@given(ex=P.examples())
def test_parity_on_drawn_configurations(ex, root):
    check(ex, root)


@pytest.mark.slow
@settings(max_examples=P.SLOW_EXAMPLES, **P.SETTINGS)
@given(ex=P.examples(slow=True))
def test_parity_on_drawn_configurations_slow(ex, root):
    check(ex, root)


def test_report_renders_host_and_property_set():
    """The committed report states the host's bf16 capability and lists every property example,
    failing ones with their reproduction commands (a fake report: no runs here)."""
    from parity_tests.report import CPU_FLAGS, markdown

    flags = dict.fromkeys(CPU_FLAGS, False) | {"avx2": True}
    host = {"date_utc": "2026-01-02 03:04", "commit": "0123456789abcdef", "dirty": False, "cpu": "Some CPU",
            "cores": 2, "cpu_flags": flags, "native_bf16": False}
    ok = {"config": "cfgA", "pass": True, "steps": 3, "max_loss_rel": 2e-7, "max_grad_norm_rel": 3e-7, "commands": "a"}
    bad = {"config": "cfgB", "pass": False, "error": "boom", "commands": "jaxpar train X\ntorchref train Y"}
    md = markdown({"host": host, "property": {"examples": [ok, bad], "bounds": P.BOUNDS, "excluded": P.EXCLUDED},
                   "pass": False})
    assert "Measured 2026-01-02 03:04 UTC at commit `0123456789ab` on Some CPU (2 cores; flags: avx2)." in md
    assert "this CPU has NO native bf16 (neither avx512_bf16 nor amx_bf16)" in md
    assert "## Property-based set (2 drawn configurations, 1 pass)" in md
    assert "| 1 | cfgA | 3 | 2.0e-07 | 3.0e-07 | PASS |" in md
    assert "| 2 | cfgB | — | — | — | FAIL: boom |" in md
    assert "```\njaxpar train X\ntorchref train Y\n```" in md
    assert all(f"- **{k}**:" in md for k in P.EXCLUDED) and md.endswith("Overall: FAIL\n")
    host = host | {"native_bf16": True, "cpu_flags": flags | {"amx_bf16": True}}
    assert "this CPU has native bf16 (amx_bf16)" in markdown({"host": host, "pass": True})
