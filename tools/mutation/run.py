"""Run the hand-written mutants (tools/mutation/mutants/, one module per wing) against the default test suite.

    python -m tools.mutation.run                      # every mutant, then tools/mutation/REPORT.md
    python -m tools.mutation.run --only NAME[,NAME]   # a subset (also --area model,ops)
    python -m tools.mutation.run --check              # only check that every mutant still applies
    python -m tools.mutation.run --list               # names, areas, files

Never edits the tree it runs from (other runs and engineers may be using it): the tracked and
untracked-but-not-ignored files are copied once into a scratch dir; each mutant is written into
that copy, the suite runs there with PYTHONPATH and cwd pointing at it (so subprocesses the tests
start import the mutated code too), and the original file is put back before the next mutant.
Bytecode caching is off in the copy: a mutant of the same size written within the same second as
a cached .pyc would otherwise be shadowed by it.

Per mutant, pytest runs twice at most, both with `-x` (stop at the first failure):
  1. the mutant's likely catchers (`Mutant.tests`), so a caught mutant costs one small run;
  2. if they all pass, the rest of the default suite (`-m 'not slow'` from pyproject, with the
     likely catchers deselected).
The first failing test is recorded as the catcher. Results are merged into results.json (by
mutant name, with the commit they ran on) and REPORT.md is rewritten from it, so partial runs
accumulate. Exit status: 0 when every mutant that ran was caught, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.mutation.mutants import EQUIVALENT, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
REPORT = HERE / "REPORT.md"
# pytest's short summary lines name the failing test: "FAILED tests/x.py::test_y[p] - msg"
FAILED_RE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - |$)", re.M)


class Stale(Exception):
    """The mutant's original snippet no longer occurs exactly once in its file."""


def apply(m: Mutant, root: Path) -> str:
    """Write mutant `m` into the tree at `root`; return the file's original text."""
    path = root / m.file
    if not path.is_file():
        raise Stale(f"{m.file} does not exist")
    text = path.read_text()
    n = text.count(m.original)
    if n != 1:
        raise Stale(f"original snippet occurs {n} times in {m.file} (must be exactly once)")
    path.write_text(text.replace(m.original, m.mutated))
    return text


def copy_tree(dst: Path) -> None:
    """Tracked + untracked-not-ignored files of ROOT into dst (what a fresh checkout would hold)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():  # deleted-but-tracked files are listed too
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def pytest(root: Path, args: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(returncode or None on timeout, output, seconds) of one pytest run inside `root`."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", *args]
    t0 = time.monotonic()
    # Own process group (setsid), so a timeout or Ctrl-C stops pytest *and* the training processes it started.
    p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out, time.monotonic() - t0
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise


def run_one(m: Mutant, root: Path, timeout: float, log, likely_only: bool = False) -> dict:
    try:
        original = apply(m, root)
    except Stale as e:
        return {"status": "STALE", "detail": str(e), "seconds": 0.0}
    try:
        # likely catchers that exist in this tree (another engineer's test file may not have landed yet)
        likely = [t for t in m.tests if (root / t.split("::")[0]).is_file()]
        phases = [("likely", likely)] if likely else []
        if not likely_only:
            # the harness's own check that every snippet applies fails in any mutated tree by
            # construction, so it must never count as the catcher
            phases.append(("suite", [f"--deselect={t}" for t in likely] + ["--ignore=tests/test_tools.py"]))
        total = 0.0
        for phase, args in phases:
            # the likely catchers in one process (no worker start-up; -x stops at the first);
            # the suite on the default two workers
            rc, out, dt = pytest(root, (["-n", "0"] if phase == "likely" else []) + args, max(timeout - total, 1.0))
            total += dt
            log(f"    {phase}: rc={rc} {dt:.0f}s")
            if rc is None:
                return {"status": "TIMEOUT", "phase": phase, "seconds": total,
                        "detail": f"suite did not finish in {timeout:.0f}s", "tail": out[-1500:]}
            if rc == 1:
                hit = FAILED_RE.search(out)
                return {"status": "CAUGHT", "phase": phase, "seconds": total,
                        "caught_by": hit.group(2) if hit else "?", "tail": out[-600:]}
            if rc not in (0, 5):  # 5: no tests collected (every likely catcher is slow-marked)
                return {"status": "ERROR", "phase": phase, "seconds": total,
                        "detail": f"pytest exited {rc}", "tail": out[-3000:]}
        return {"status": "MISSED-LIKELY" if likely_only else "SURVIVED", "seconds": total}
    finally:
        (root / m.file).write_text(original)


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def cpu_flags() -> str:
    from jaxpar.tolerances import proc_cpu_flags  # the host that ran, not an emulation's $JAXPAR_CPU_FLAGS

    if not (flags := proc_cpu_flags()):
        return "unknown"
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none of avx2/avx512"


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def save_results(results: dict) -> None:
    """Temp file + rename: a run going on beside this one never reads a half-written results.json
    (it did: json.loads('') in its load_results)."""
    tmp = RESULTS.with_name(f".{RESULTS.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, RESULTS)


def write_report(results: dict) -> None:
    by_status: dict[str, int] = {}
    for m in MUTANTS:
        s = results.get(m.name, {}).get("status", "NOT RUN")
        by_status[s] = by_status.get(s, 0) + 1
    areas = sorted({m.area for m in MUTANTS})
    lines = [
        "# Mutation report",
        "",
        "Written by `python -m tools.mutation.run` (see tools/mutation/run.py); do not edit by hand.",
        f"{len(MUTANTS)} mutants over {len(areas)} areas ({', '.join(areas)}); "
        + ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items())) + ".",
        "",
        "Each mutant is one small real bug (file, exact original snippet -> mutated snippet, tools/mutation/mutants/).",
        "It runs against the default suite with `-x`, its likely catchers first; `caught by` is the first failing",
        "test, `s` the wall time (on a shared 2-core host: inflated by other load). NOT RUN: not in the runs so far.",
        "MISSED-LIKELY: its likely catchers passed in a triage run (`--likely-only`); it has not been run against",
        "the whole default suite yet (a plain run does that: phase `suite`). SURVIVED: the whole suite passed.",
        "",
        "| mutant | area | status | caught by | phase | s | commit | bug |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in MUTANTS:
        r = results.get(m.name, {})
        caught = r.get("caught_by", r.get("detail", "")).replace("|", "\\|")
        lines.append(f"| {m.name} | {m.area} | {r.get('status', 'NOT RUN')} | {caught} | {r.get('phase', '')} | "
                     f"{r.get('seconds', 0):.0f} | {r.get('commit', '')} | {m.why} |")
    lines += ["", "## Equivalent mutants (removed)", "",
              "Changes that cannot alter any observable result; kept here with the reason instead of in the list.", ""]
    lines += [f"- `{e.file}`: `{e.original.strip()}` -> `{e.mutated.strip()}`: {e.why}" for e in EQUIVALENT]
    hosts = sorted({r.get("host", "") for r in results.values() if r.get("host")})
    lines += ["", f"Hosts (CPU flags): {'; '.join(hosts) or 'n/a'}", ""]
    REPORT.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mutation.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--area", default="", help="comma-separated areas")
    ap.add_argument("--check", action="store_true", help="only check every selected mutant still applies")
    ap.add_argument("--list", action="store_true", help="list mutants and exit")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant (both phases)")
    ap.add_argument("--likely-only", action="store_true",
                    help="triage: run only the likely catchers; a mutant they miss is recorded as MISSED-LIKELY "
                         "(not yet run against the whole suite)")
    ap.add_argument("--skip-done", action="store_true", help="skip mutants already CAUGHT at this commit")
    a = ap.parse_args(argv)
    names, areas = [x for x in a.only.split(",") if x], [x for x in a.area.split(",") if x]
    known = {m.name for m in MUTANTS}
    unknown = [n for n in names if n not in known] + [x for x in areas if x not in {m.area for m in MUTANTS}]
    if unknown:
        print(f"error: unknown mutant names or areas {unknown}", file=sys.stderr)
        return 2
    sel = [m for m in MUTANTS if (not names or m.name in names) and (not areas or m.area in areas)]
    if a.list:
        for m in sel:
            print(f"{m.name:32s} {m.area:12s} {m.file}")
        return 0
    commit, results = git_commit(), load_results()
    if a.skip_done:
        sel = [m for m in sel if not (results.get(m.name, {}).get("status") == "CAUGHT"
                                      and results[m.name].get("commit") == commit)]
    with tempfile.TemporaryDirectory(prefix="jaxpar-mutants-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        if a.check:
            stale = []
            for m in sel:
                try:
                    original = apply(m, root)
                    subprocess.run([sys.executable, "-c", f"import ast,sys; ast.parse(open({str(root / m.file)!r}).read())"],
                                   check=True)
                    (root / m.file).write_text(original)
                except (Stale, subprocess.CalledProcessError) as e:
                    stale.append(f"{m.name}: {e}")
            print("\n".join(stale) or f"all {len(sel)} mutants apply and parse")
            return 1 if stale else 0
        for i, m in enumerate(sel, 1):
            print(f"[{i}/{len(sel)}] {m.name} ({m.file})", flush=True)
            r = run_one(m, root, a.timeout, lambda s: print(s, flush=True), a.likely_only)
            r.update(commit=commit, host=cpu_flags(), at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
            print(f"    {r['status']} {r.get('caught_by', r.get('detail', ''))}", flush=True)
            results = load_results()  # another run may have written meanwhile
            results[m.name] = r
            save_results(results)
            write_report(results)
    write_report(load_results())
    bad = [m.name for m in sel if load_results().get(m.name, {}).get("status") != "CAUGHT"]
    print(f"{len(sel) - len(bad)}/{len(sel)} caught" + (f"; not caught: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
