"""examples/07_plan.py: plans GPT-2 XL for 64 H100s, then applies a small plan on 8 emulated CPU devices."""

import json
import math
import subprocess
import sys
from pathlib import Path

from support.cli_helpers import clean_env

ROOT = Path(__file__).resolve().parents[2]


def test_example_07_plans_and_trains(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "07_plan.py"), "--steps", "2", "--out", str(tmp_path)],
                       check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=clean_env(XLA_FLAGS="--xla_cpu_enable_fast_math=false"))  # a user's own flag (a no-op)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    plan = json.loads((tmp_path / "plan_gpt2-xl_64xh100.json").read_text())
    m = plan["mesh"]
    assert m["data"] * m["fsdp"] * m["tensor"] * m["pipe"] == 64
    assert plan["memory_per_device_bytes"] <= 80 * 2**30 and 0.05 < plan["mfu"] < 0.8
    assert len(plan["candidates"]) == 4 and out.count("GiB │") == 5
    # the small plan becomes overrides whose mesh covers the 8 devices, and training runs with them
    ov = dict(kv.split("=") for kv in next(ln for ln in out.splitlines() if ln.startswith("overrides:")).split()[1:])
    assert math.prod(int(ov[f"mesh.{k}"]) for k in ("data", "fsdp", "tensor", "pipe")) == 8
    losses = json.loads(next(ln for ln in out.splitlines() if ln.startswith("losses:")).split(":", 1)[1])
    assert len(losses) == 2 and all(math.isfinite(x) and 4.0 < x < 6.5 for x in losses)  # ~ln(256) = 5.55 at init
