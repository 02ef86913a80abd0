"""Library use: build a GPT-2, train it a few steps on the built-in corpus, sample from it.

    python examples/01_train_gpt2.py            # ~20 s on a laptop CPU
"""

import dataclasses
import tempfile

import jax

from gpt2common import data
from jaxpar import config as C
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.run.sample import generate
from jaxpar.train import build_trainer

# 1. A config: the tiny preset, short sequences, a high learning rate for a quick demo.
cfg = C.resolve(["model=gpt2-tiny", "train.steps=60", "train.seq_len=64", "train.batch_size=16",
                 "train.lr=3e-3", "train.warmup_steps=10", "precision=bf16"])

# 2. Data: tokenize the built-in corpus (tiny Shakespeare, shipped in the package) bytewise.
workdir = tempfile.mkdtemp()
prepared = data.resolve_data("", "byte", workdir)
ds = data.Dataset.open(prepared, cfg.model.vocab_size, cfg.train.seq_len)

# 3. Model + optimizer on a 1-device mesh; params come from the shared numpy initialiser.
trainer = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
state = trainer.init_state(gpt2.init_params(cfg.model, seed=cfg.seed))
print(f"{gpt2.count_params(state['params']):,} parameters")

# 4. Train: each global batch is a pure function of (seed, step).
for step in range(cfg.train.steps):
    x, y = data.train_batch(ds, cfg.train.seq_len, cfg.train.batch_size, cfg.seed, step)
    state, m = trainer.step_fn(state, trainer.put_batch(x), trainer.put_batch(y))
    if step % 10 == 0 or step == cfg.train.steps - 1:
        print(f"step {step + 1:3d}  loss {float(m['loss']):.3f}")

# 5. Sample 80 bytes after a prompt.
tok = data.load_tokenizer(prepared)
params = jax.device_get(state["params"])
ids = generate(dataclasses.replace(cfg), params, tok.encode("ROMEO:"), 80, temperature=0.8, top_k=40, seed=0)
print(tok.decode(ids))
