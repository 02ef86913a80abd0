"""Property-based tests (hypothesis) of what a run reads back from its run dir (README
"Reliability"): the metrics.jsonl a resume rewrites (jaxpar.run.metrics.truncate_after: over any mix
of metrics records, foreign lines and a torn last line, the file keeps exactly the records of
steps <= the checkpoint step, in order, and nothing else; it never raises), and the checkpoint
step dirs a run counts (jaxpar.run.rundir.checkpoint_steps, among any foreign names).
"""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxpar.run import rundir
from jaxpar.run.metrics import truncate_after

RECORDS = st.builds(lambda s, loss: (s, json.dumps({"step": s, "loss": loss, "lr": 1e-3})),
                    st.integers(0, 60), st.none() | st.floats(0, 20))
# Lines a metrics.jsonl may hold that are not records: text that is not JSON, JSON that is not an
# object with a step, and objects whose step no int() reading takes (JSON's non-finite numbers
# included, which Python's json reads as float inf / nan).


def _not_an_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


NO_STEP = st.one_of(st.none(), st.text(max_size=5).filter(_not_an_int),
                    st.lists(st.integers(), max_size=2), st.sampled_from([float("inf"), -float("inf"), float("nan"), 1e400]))
FOREIGN = st.one_of(
    st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20).map(lambda s: "#" + s),
    st.builds(lambda v: json.dumps({"step": v}), NO_STEP),
    st.builds(json.dumps, st.lists(st.integers(), max_size=3) | st.integers() | st.dictionaries(st.sampled_from("abc"), st.integers())),
)


@settings(max_examples=100, deadline=None)
@example(lines=[(1, '{"step": 1}'), (None, '{"step": Infinity}')], torn=None, step=5)  # OverflowError traceback
@example(lines=[(None, "[" * 100_000), (3, '{"step": 3}')], torn=None, step=3)  # RecursionError traceback
@example(lines=[(2, '{"step": 2}')], torn='{"step": 4, "loss": 0.2', step=3)  # a kill -9 mid-write
@given(lines=st.lists(RECORDS | FOREIGN.map(lambda s: (None, s)), max_size=12),
       torn=st.none() | RECORDS.flatmap(lambda r: st.integers(1, len(r[1]) - 1).map(lambda k: r[1][:k])),
       step=st.integers(0, 60))
def test_a_resume_keeps_exactly_the_records_up_to_its_step(tmp_path_factory, lines, torn, step):
    """Reference: the records drawn (their steps), the rest dropped; a missing file stays missing."""
    path = tmp_path_factory.mktemp("m") / "metrics.jsonl"
    truncate_after(str(path), step)
    assert not path.exists()
    path.write_text("".join(line + "\n" for _, line in lines) + (torn or ""))
    truncate_after(str(path), step)
    assert path.read_text() == "".join(line + "\n" for s, line in lines if s is not None and s <= step)


# any file name but the step names jaxpar writes (str(step): ASCII digits); Unicode digits included
NAMES = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=6).filter(
    lambda s: s not in (".", "..") and not (s.isascii() and s.isdigit()) and len(s.encode()) < 200)


@settings(max_examples=100, deadline=None)
@example(steps={3}, dirs={"\u00b2", "5.orbax-checkpoint-tmp-1"}, files={"7"})  # '²'.isdigit(), int('²') raises
@example(steps=set(), dirs={"\u0663"}, files=set())  # Arabic-Indic three: not a step jaxpar wrote
@given(steps=st.sets(st.integers(0, 10**7), max_size=5), dirs=st.sets(NAMES, max_size=4),
       files=st.sets(st.integers(0, 99).map(str) | NAMES, max_size=3))
def test_the_checkpoint_steps_are_the_step_dirs_written_among_any_other_names(tmp_path_factory, steps, dirs, files):
    """checkpoint_steps: the step dirs (names str(step), as jaxpar's checkpoints write them) under
    <out>/ckpt, ascending; other dirs (orbax's temporaries, anything else) and files are not steps,
    and no name makes it raise. A dir with no step dir is a failed run's leftovers (is_restartable).
    Reference: the steps drawn."""
    out = tmp_path_factory.mktemp("run")
    ck = out / rundir.CKPT_DIR
    ck.mkdir()
    for s in steps:
        (ck / str(s)).mkdir()
    for n in dirs:
        (ck / n).mkdir()
    for n in files - {str(s) for s in steps} - dirs:
        (ck / n).write_text("")
    assert rundir.checkpoint_steps(str(out)) == sorted(steps)
    assert rundir.is_restartable(str(out)) == (not steps)
