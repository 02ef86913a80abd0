"""gpt2common: what jaxpar and torchref legitimately share, and nothing else.

The declared boundary between the two frameworks. Both import this package; neither imports the
other (torchref imports nothing from `jaxpar`, tests/test_import_graph.py checks it), and this
package imports neither jax nor torch, nor anything of jaxpar or torchref, so torchref's worker
processes start without jax and the reference stays independent of the code it checks.

  grammar.py  the config grammar: `key=value` / YAML parsing, value coercion, `ConfigError`
  model.py    the GPT-2 shape (`ModelConfig`) and its presets, which both sides build
  optim.py    the optimizer/schedule/batch settings both run with (`OptimSettings`)
  init.py     the numpy initialiser both frameworks start from (HF GPT-2's distribution)
  hf.py       the HF weight format: params <-> HF state-dict names/shapes, config.json
  hf_tokenizer.py  a run's tokenizer as HF tokenizer files (AutoTokenizer)
  data.py     the data layout: tokenizers, uint16 token files, the (seed, step) batch order
  outdir.py   the two checks any run makes on `out=` before writing (writable, creatable)
  state.py    the training-state format (weights, AdamW moments, step, data position, RNG) both
              frameworks write and continue (docs/state_format.md)

Everything here is numpy + the standard library (+ safetensors, tokenizers, pyyaml).
"""
