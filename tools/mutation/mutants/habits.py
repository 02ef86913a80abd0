"""Mutants of the four test habits of docs/testing.md ("Four habits"), across the wings: the eight
bugs that once passed the whole default suite, and more of each class.

Areas: `structure` (a switch that changes structure or memory but not numbers), `tables` (an entry
of a table of settings, bounds or keys), `boundaries` (a race or a boundary: final steps, skipped
steps, NaN, a lock's interleaving), `shapes` (a field read in place of its gpt2-tiny twin).
`python -m tools.mutation --area structure,tables,boundaries,shapes` prints the catch rate.
"""

from tools.mutation.mutants.common import Mutant, T

SP = T + "parallel/test_sequence_parallel.py::test_sequence_parallel_is_in_effect_in_every_program"
BISECT = T + "run/test_bisect.py"
STATE = T + "run/test_state_format.py"
LOCK = T + "run/test_failures_outlock.py"

MUTANTS: list[Mutant] = [
    # ---- structure
    Mutant("sp_off_in_shard_map_programs", "structure", "jaxpar/parallel/layout.py",
           "        inner.update(SEQUENCE_PARALLEL_RULES)\n", "",
           "tensor.sequence_parallel=true leaves T whole inside the pipeline stages and ZeRO-3's explicit loss "
           "(the rules they trace under): the same numbers, no memory saved",
           (SP,)),
    Mutant("sp_off_in_zero3_loss", "structure", "jaxpar/parallel/fsdp.py",
           "with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):  # tensor: the only auto axis",
           "with activation_rules(jax.sharding.get_abstract_mesh(), {**lay.pipeline_rules, \"resid_seq\": None}):",
           "ZeRO-3's explicit loss keeps the residual stream whole under tensor.sequence_parallel=true",
           (SP + "[fsdp=2,tensor=2]",)),
    Mutant("sp_off_in_table_schedules", "structure", "jaxpar/parallel/pipeline_exec.py",
           "        with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):\n"
           "            (_, _, _, _, gw, go, loss), _ = jax.lax.scan(tick, carry, plan)",
           "        with activation_rules(jax.sharding.get_abstract_mesh(), {**lay.pipeline_rules, \"resid_seq\": None}):\n"
           "            (_, _, _, _, gw, go, loss), _ = jax.lax.scan(tick, carry, plan)",
           "the table schedules' (1f1b, zb, interleaved) stages keep T whole under tensor.sequence_parallel=true",
           (SP + "[pipe=2,tensor=2/1f1b]",)),
    # ---- tables
    Mutant("state_pins_no_warmup", "tables", "gpt2common/state.py",
           '    diffs += [(f"train.{k}", getattr(train, k), m["train"].get(k)) for k in TRAIN_KEYS]',
           '    diffs += [(f"train.{k}", getattr(train, k), m["train"].get(k)) for k in TRAIN_KEYS if k != "warmup_steps"]',
           "init_state= accepts another train.warmup_steps: the continued run follows another schedule, silently",
           (STATE + "::test_every_setting_the_state_pins_is_refused_when_changed_once",)),
    Mutant("state_pins_no_layer_norm_eps", "tables", "gpt2common/state.py",
           '    diffs = [(f"model.{k}", getattr(model, k), m["model"].get(k)) for k in SHAPE_KEYS]',
           '    diffs = [(f"model.{k}", getattr(model, k), m["model"].get(k)) for k in SHAPE_KEYS[:-1]]',
           "init_state= accepts another model.layer_norm_epsilon: every LayerNorm computes another function",
           (STATE + "::test_every_setting_the_state_pins_is_refused_when_changed_once",)),
    Mutant("bisect_fp32_grads_at_bf16_bound", "tables", "jaxpar/run/bisect_compare.py",
           '    _, value, metric = bd["grad"]', '    _, value, metric = bounds(True)["grad"]',
           "bisect judges fp32 gradient rows with the bf16 l2 bound (7.8e-3 for 3e-6): a gradient-only bug "
           "up to ~1e-3 reads clean",
           (BISECT + "::test_each_kind_is_judged_at_its_own_bound",)),
    Mutant("bisect_fp32_activation_at_loss_bound", "tables", "jaxpar/run/bisect_compare.py",
           '{"activation": ("bisect.fp32.activation", "inf")', '{"activation": ("parity.fp32.loss", "inf")',
           "bisect judges fp32 activations with the loss's bound",
           (BISECT + "::test_each_kind_is_judged_at_its_own_bound",)),
    # ---- boundaries
    Mutant("bisect_nan_row_ok", "boundaries", "jaxpar/run/bisect_compare.py",
           "max_abs, rel, bound, not rel <= bound)", "max_abs, rel, bound, rel > bound)",
           "bisect reads a NaN row as within its bound: a side that goes non-finite is clean throughout",
           (BISECT + "::test_a_side_that_goes_nonfinite_is_named_where_it_first_does",)),
    Mutant("bisect_nan_adam_row_ok", "boundaries", "jaxpar/run/bisect_compare.py",
           "rel, shown, not ratio <= 1.0))", "rel, shown, ratio > 1.0))",
           "bisect reads a NaN moment or update as within its bound",
           (BISECT + "::test_a_side_that_goes_nonfinite_is_named_where_it_first_does",)),
    Mutant("init_state_schedule_from_step", "boundaries", "jaxpar/run/handoff.py",
           'np.int32(opt["schedule_count"]))', "np.int32(st.step))",
           "jaxpar train init_state= takes the schedule count from the state's step: a state written after skipped "
           "non-finite steps continues at another learning rate",
           (STATE + "::test_a_state_with_skipped_steps_continues_its_own_schedule_count",)),
    Mutant("torchref_no_state_after_the_last_step", "boundaries", "torchref/handoff.py",
           "(step % state_every == 0 or step == last)", "(step % state_every == 0)",
           "torchref state_every=N with N not dividing train.steps never writes the final state",
           (T + "torchref/test_torchref_strategies.py::test_state_every_not_dividing_the_steps_still_writes_the_last_state",)),
    Mutant("outlock_compares_st_dev", "boundaries", "gpt2common/outdir.py",
           "same = os.fstat(fd).st_ino == os.lstat(path).st_ino", "same = os.fstat(fd).st_dev == os.lstat(path).st_dev",
           "a run released between a starter's open() and flock(): the starter holds the unlinked file beside "
           "the new holder (two writers in one out)",
           (LOCK + "::test_a_release_between_a_starters_open_and_flock_never_gives_two_holders",)),
    Mutant("outlock_vanished_path_is_held", "boundaries", "gpt2common/outdir.py",
           "        except FileNotFoundError:\n            same = False\n",
           "        except FileNotFoundError:\n            same = True\n",
           "a starter whose lock file was unlinked under it holds that file: the path is free for the next run",
           (LOCK + "::test_a_release_between_a_starters_open_and_flock_leaves_the_starter_holding_the_path",)),
    Mutant("logged_lr_ignores_skipped_steps", "boundaries", "jaxpar/run/loop.py",
           '"lr": float(lrs[n - 1 - skipped]),', '"lr": float(lrs[n - 1]),',
           "after a skipped non-finite step metrics.jsonl's lr is the schedule at step - 1, not at the "
           "updates applied: every later line shows another lr than the one applied",
           (T + "run/test_failures_nonfinite.py::test_failed_run_restarts_in_place_and_skips_nonfinite_steps",)),
    # ---- shapes
    Mutant("export_max_length_is_vocab", "shapes", "jaxpar/run/export.py",
           "save_tokenizer(to_hf, tok, cfg.model.n_positions, source_dir)",
           "save_tokenizer(to_hf, tok, cfg.model.vocab_size, source_dir)",
           "the exported tokenizer_config.json's model_max_length is the vocab (50257 for GPT-2), not the "
           "context: truncation no longer cuts at n_positions",
           (T + "run/test_hf_export.py::test_export_of_a_gpt2_tokenizer_run_carries_its_vocab_and_merges",)),
    Mutant("bisect_layers_from_heads", "shapes", "jaxpar/run/bisect_compare.py",
           "    L = cfg_b.model.n_layer\n", "    L = cfg_b.model.n_head\n",
           "bisect walks n_head layers: rows of missing layers, or layers never compared",
           (BISECT + "::test_clean_jaxpar_vs_torchref_flags_nothing_and_lines_up_every_name",)),
    Mutant("sample_cli_window_is_vocab", "shapes", "jaxpar/run/sample.py",
           "    W = min(cfg.model.n_positions, len(ids) + n)", "    W = min(cfg.model.vocab_size, len(ids) + n)",
           "`jaxpar sample` sizes its window by the vocab: a decode past n_positions feeds the model more "
           "positions than wpe holds",
           (T + "run/test_claims_sample.py::test_sample_a_converted_run_with_the_hf_dirs_tokenizer",)),
]
