"""TensorBoard events of `jaxpar train` without importing torch (tensorboardX would, 4 s per run).

Reference: the values logged, read back with a hand-written TFRecord reader (length, crc, Event)."""

import json
import struct
import subprocess
import sys

import pytest

pytest.importorskip("tensorboardX", reason="needs the [tensorboard] extra: pip install -e '.[tensorboard]'")

SCRIPT = """
import json, sys
from jaxpar.run.metrics import MetricsLogger
m = MetricsLogger(sys.argv[1], 2, 0, "none")
m.log({"step": 1, "loss": 2.5, "tokens_per_s": 1024.0, "step_time_s": 0.25, "mfu": 0.125})
m.log({"step": 2, "loss": 2.25, "tokens_per_s": 2048.0, "step_time_s": 0.5, "mfu": 0.0625})
m.close()
print(json.dumps({"torch": "torch" in sys.modules, "tb": m.tb is not None}))
"""


def _events(path):
    """Every Event of one event file (TFRecord: u64 length, u32 crc, payload, u32 crc)."""
    from tensorboardX.proto import event_pb2

    data, i = path.read_bytes(), 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        ev = event_pb2.Event()
        ev.ParseFromString(data[i + 12:i + 12 + n])
        yield ev
        i += 12 + n + 4


def _scalars(path) -> list[tuple[int, str, float]]:
    return [(ev.step, v.tag, v.simple_value) for ev in _events(path) for v in ev.summary.value]


def test_tensorboard_events_written_without_importing_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"torch": False, "tb": True}
    (events,) = (tmp_path / "tb").iterdir()
    got = _scalars(events)
    assert [(s, t, v) for s, t, v in got if t == "loss"] == [(1, "loss", 2.5), (2, "loss", 2.25)]
    assert (2, "mfu", 0.0625) in got and (1, "tokens_per_s", 1024.0) in got
    # one scalar per metric per step; `step` is the x axis, not a metric of its own
    assert sorted(t for s, t, _ in got if s == 1) == ["loss", "mfu", "step_time_s", "tokens_per_s"]


PURGE_SCRIPT = """
import sys
from jaxpar.run.metrics import MetricsLogger
for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):  # a run to step 3, resumed from its checkpoint at 2
    m = MetricsLogger(sys.argv[1], 4, start, "none")
    for s in steps:
        m.log({"step": s, "loss": 10.0 * start + s, "tokens_per_s": 1.0, "step_time_s": 1.0, "flops_per_s": 1.0})
    m.close()
"""


def _purge_steps(path) -> list[int]:
    """Steps of the SessionLog START events (TensorBoard's purge marker) in one event file."""
    from tensorboardX.proto import event_pb2

    return [ev.step for ev in _events(path)
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START]


def test_resumed_run_purges_the_replayed_steps_from_its_tensorboard_curves(tmp_path):
    """TensorBoard drops the earlier event files' points from a START marker's step on: the
    resumed writer's file carries the marker at the first replayed step (3), the first run's none,
    so the joined curve is 1, 2 from the first run and 3, 4 from the resumed one."""
    r = subprocess.run([sys.executable, "-c", PURGE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, resumed = sorted((tmp_path / "tb").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert _purge_steps(first) == [] and _purge_steps(resumed) == [3]
    assert [(s, v) for s, t, v in _scalars(resumed) if t == "loss"] == [(3, 23.0), (4, 24.0)]
