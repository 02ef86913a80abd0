"""No tracked file speaks of how jaxpar was developed; code, docs and result files speak of the product.

History lives in git. A reader of the tree (or of a result file's name) must not need to know which
work branch, issue or commit produced a line, so these are failures, reported as `file:line: rule:
text` for every hit:

- `code name`: a work-branch code name: `h`, a capital, an optional capital or digit and an optional
  small letter (`hC`, `hZ2N`), or `h`, one or two digits and an optional small letter (`h18a`).
  Case-sensitive; GPU names (`h100`, `h200`) have three digits and do not match. Checked in file
  paths as well as text.
- `process word`: the three words of the `process word` entry of `RULES` (and their plurals and past forms) as whole
  words, any case. Whole word means Python's `\\b` on both sides, so identifiers that carry the word
  after an underscore (`_helper`, `cli_helpers.py`, `start_new_session`) do not match: they name code,
  not how it was made.
- `issue number`: the word issue(s) followed by a number, or a hash sign glued to a number.
- `commit hash`: a word of 7-40 hex digits with at least one digit and one letter. Not a hash: the
  digits after a decimal point (`1.1754942e-38`) and a decimal exponent (`12e34`). A hash is real data
  only where a tool records the commit it measured: the value of a JSON `"commit"` key and the parity
  report's "at commit `...`" line written from it.
- `these machines`: the phrase, any case (the product runs on the user's machines).
- `outside link`: an http(s) URL; a relative path climbing up (`../x/y`) that names no tracked file
  or folder, seen from the file's folder; a capitalised Markdown name (`DESIGN.md`) that no tracked
  file has. Files of other projects are cited by name, not linked.

The only exceptions are the texts in `ALLOWED`, each with its reason: pytest's `scope="session"`,
the PyTorch wheel index of the install command (it picks the CPU or CUDA build of torch), XLA's GPU
profiler thread names (`Stream #14(...)`) and the mutation tool's generated `REPORT.md`.

Every tracked file is read except binary ones (a NUL byte in the first 8 KiB, or not UTF-8) and this
file, which has to spell the patterns it looks for. `test_each_rule_catches_its_planted_trace` shows
that every rule fires, so the tree test cannot pass by matching nothing.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

CODE_NAME = re.compile(r"\bh(?:[A-Z][A-Z0-9]?|[0-9]{1,2})[a-z]?\b")
RULES = [
    ("code name", CODE_NAME),
    ("process word", re.compile(r"\b(?:sessions?|leas(?:e|es|ed|ing)|helpers?)\b", re.IGNORECASE)),
    ("issue number", re.compile(r"\bissues?\s+#?[0-9]+|(?<![\w&#])#[0-9]+\b", re.IGNORECASE)),
    ("commit hash", re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")),
    ("these machines", re.compile(r"\bthese\s+machines\b", re.IGNORECASE)),
    ("outside link", re.compile(r"https?://\S+|(?<![\w.])(?:\.\./)+[\w./-]*[\w-]|\b[A-Z][A-Z_]*\.md\b")),
]
DECIMAL_EXPONENT = re.compile(r"[0-9]+e[0-9]*")
# Texts (regexes) a rule may match inside, each with its reason. Keep this list short.
ALLOWED = {
    r'scope="session"': "pytest's fixture scope",
    r"https://download\.pytorch\.org/whl/\S*": "the PyTorch wheel index of the install command",
    r"Stream #[0-9]+\(": "XLA GPU profiler thread names (Stream #14(Compute)) in traces and profiles",
    r"\bREPORT\.md\b": "the report `python -m tools.mutation` writes (generated, not versioned)",
}
JSON_COMMIT = re.compile(r'"commit":\s*"[0-9a-f]{7,40}"')
REPORT_COMMIT = re.compile(r"at commit `[0-9a-f]{7,40}`")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def read_text(path):
    """The file's lines, or None for a binary file (NUL in the first 8 KiB or not UTF-8)."""
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None


def _exists(rel, tracked):
    return rel in tracked or any(t.startswith(rel + "/") for t in tracked)


def _allowed(rule, m, line, path, tracked):
    text = m.group(0)
    if any(a.start() <= m.start() and m.end() <= a.end() for rx in ALLOWED for a in re.finditer(rx, line)):
        return True
    if rule == "commit hash":
        if DECIMAL_EXPONENT.fullmatch(text):
            return True
        return any(c.start() <= m.start() < c.end() for pat in (JSON_COMMIT, REPORT_COMMIT)
                   for c in pat.finditer(line))
    if rule == "outside link" and text.endswith(".md") and not text.startswith("."):
        return text in {os.path.basename(t) for t in tracked}
    if rule == "outside link" and text.startswith(".."):
        return _exists(os.path.normpath(os.path.join(os.path.dirname(path), text)), tracked)
    return False


def scan_lines(path, lines, tracked=frozenset()):
    """[(path, line number, rule, matched text)] for every trace in `lines` of the file `path`."""
    # in a file name "_" separates words (single_device_small_hXn.json)
    hits = [(path, 0, "code name", m.group(0)) for m in CODE_NAME.finditer(path.replace("_", " "))]
    for i, line in enumerate(lines, 1):
        for name, rx in RULES:
            hits += [(path, i, name, m.group(0)) for m in rx.finditer(line)
                     if not _allowed(name, m, line, path, tracked)]
    return hits


def scan_tree():
    files = tracked_files()
    tracked = frozenset(files)
    hits, read = [], 0
    for path in files:
        if path == SELF or not (ROOT / path).is_file():
            continue
        lines = read_text(path)
        if lines is None:
            hits += scan_lines(path, [], tracked)  # its name still counts
            continue
        read += 1
        hits += scan_lines(path, lines, tracked)
    return hits, read


def test_tracked_files_carry_no_development_traces():
    hits, read = scan_tree()
    assert read >= 100  # the tree was read, not an empty listing
    report = "\n".join(f"{p}:{i}: {rule}: {text}" for p, i, rule, text in hits)
    assert not hits, f"{len(hits)} development traces (see tests/test_no_dev_traces.py):\n{report}"


PLANTED = [  # (line, rule, matched text); the traces are assembled so this file's text stays plain
    ("measured on branch " + "h" + "Q2 today", "code name", "h" + "Q2"),
    ("see " + "h" + "18a's test", "code name", "h" + "18a"),
    ("the " + "h" + "C layout", "code name", "h" + "C"),
    ("a later " + "Ses" + "sion will fix it", "process word", "Ses" + "sion"),
    ("one " + "lea" + "se of a GPU", "process word", "lea" + "se"),
    ("a small " + "help" + "er function", "process word", "help" + "er"),
    ("the bug " + "iss" + "ue 18 found", "issue number", "iss" + "ue 18"),
    ("fixed in " + "#" + "23.", "issue number", "#" + "23"),
    ("since main at 7dc" + "75a4 the loss", "commit hash", "7dc" + "75a4"),
    ("install torch on " + "these " + "machines", "these machines", "these " + "machines"),
    ("see " + "https" + "://example.org/paper", "outside link", "https" + "://example.org/paper"),
    ("notes in `" + "../" + "shared/notes.txt", "outside link", "../" + "shared/notes.txt"),
    ("the contract in " + "DES" + "IGN.md", "outside link", "DES" + "IGN.md"),
]


@pytest.mark.parametrize("line,rule,text", PLANTED, ids=[p[1] + ":" + p[2] for p in PLANTED])
def test_each_rule_catches_its_planted_trace(line, rule, text):
    assert scan_lines("docs/x.md", [line]) == [("docs/x.md", 1, rule, text)]


@pytest.mark.parametrize("line", [
    "def _helper(x):  # cli_helpers.py, start_new_session=True",
    '@pytest.fixture(scope="session")',
    "an h100 or h200 GPU; 8 heads of head_dim 64",
    "np.float32(1.1754942e-38), 3.3895e38 and 12e3456",
    "pip install torch --index-url " + "https" + "://download.pytorch.org/whl/cpu",
    "see [the README](../README.md) and parity.md; deadbeef and 1234567 are not hashes",
    "released, pleased, increase; the thread Stream #14(Compute)",
])
def test_legitimate_text_does_not_match(line):
    assert scan_lines("docs/x.md", [line], frozenset({"README.md", "docs/x.md"})) == []


def test_commit_hash_allowed_only_as_recorded_provenance():
    h = "7dc" + "75a4ce49e"
    assert scan_lines("r/x.json", [json.dumps({"commit": h})]) == []
    assert scan_lines("r/x.md", [f"Measured 2026-01-02 at commit `{h}` on a CPU."]) == []
    assert scan_lines("r/x.json", [json.dumps({"note": "since " + h})]) == [("r/x.json", 1, "commit hash", h)]


def test_file_names_and_binary_files():
    path = "benchmarks/results/x_" + "h" + "Q2.json"
    assert scan_lines(path, []) == [(path, 0, "code name", "h" + "Q2")]
    assert read_text("gpt2common/corpus/tinyshakespeare.txt.gz") is None
    assert SELF in tracked_files() and "README.md" in tracked_files()
