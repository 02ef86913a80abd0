"""The docs describe the tree as it is: a renamed or moved file fails here, not in a reader's hands.

Checked: docs/architecture.md names every module of jaxpar/ (a newcomer finds each one there);
every file path the docs quote in backticks is a tracked file (a path may be given from the
repository root or from inside a package: `run/loop.py`; files of other projects are cited
without backticks); benchmarks/README.md has one section per benchmark script and stays within 400
lines; the README starts with the two set-up commands, and .ci/run runs the README's test command.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/architecture.md", "benchmarks/README.md", "jaxpar/planner/README.md",
        "parity_tests/README.md", "torchref/README.md", "examples/README.md"]
QUOTED_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|sh|txt|toml|yaml))`")


def test_architecture_names_every_jaxpar_module():
    text = (ROOT / "docs/architecture.md").read_text()
    missing = []
    for path in sorted((ROOT / "jaxpar").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT / "jaxpar")
        # named by its file name inside its wing's section, or by its path
        if f"`{path.name}`" not in text and str(rel) not in text and rel.as_posix() not in text:
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md does not name: {missing}"
    for wing in ("parallel", "models", "run", "planner"):
        assert f"## jaxpar/{wing}/" in text


def test_quoted_file_paths_exist():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for doc in DOCS:
        for m in QUOTED_PATH.finditer((ROOT / doc).read_text()):
            p = m.group(1)
            if not any(t == p or t.endswith("/" + p) for t in tracked):
                missing.append(f"{doc}: {p}")
    assert not missing, missing


def test_benchmark_readme_has_one_section_per_script_and_at_most_400_lines():
    text = (ROOT / "benchmarks/README.md").read_text()
    assert len(text.splitlines()) <= 400
    headings = [h for h in re.findall(r"^## (.+)$", text, re.M)]
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) + ["gpu_session.sh"]
    missing = [s for s in scripts if not any(s in h for h in headings)]
    assert not missing, f"benchmarks/README.md has no section for {missing}"


def test_readme_starts_with_the_set_up_commands_ci_runs():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```")]
    assert lines.index("```bash") <= 2
    assert block[0].startswith('pip install -e ".[torch,mpi,tensorboard,dev]" && jaxpar train ')
    assert block[1] == "python -m pytest -q"
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert "python -m pytest -q" in ci
