"""`jaxpar prepare` at scale: MB/s and peak RSS over corpus size and workers, beside nanoGPT's recipe.

Synthetic JSONL corpora of many documents (Zipf-distributed words, 50-2000 words a document) are
generated into a temp dir (never committed) at each `--sizes` MB. For each size and each worker
count, in one run on one host:
  * jaxpar: `jaxpar prepare input=c.jsonl tokenizer=<tok.json> workers=N` in a fresh process;
  * nanoGPT's recipe (data/openwebtext/prepare.py): HF `datasets` `load_dataset("json")`,
    `.map(num_proc=N)` with the same tokenizer's `encode` + end-of-text, then a uint16 memmap
    writer over 1024 shards of the mapped dataset; skipped (and said) without `datasets`.
The tokenizer is a byte-level BPE with <|endoftext|> trained on the smallest corpus (GPT-2's own
files are not shipped offline; the algorithm and pre-tokenizer are GPT-2's). Peak RSS is the
child's ru_maxrss, children of the child included (the workers). Written: a table on stdout and
`--out` JSON with the host's CPU flags and versions.

    python benchmarks/prepare_scale.py --sizes 100 300 1000 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile

NANOGPT = r'''
import sys, numpy as np, os
from datasets import load_dataset
from tokenizers import Tokenizer
src, tokfile, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tokfile)
eot = tok.token_to_id("<|endoftext|>")
ds = load_dataset("json", data_files=src, split="train", cache_dir=out + "/cache")
def process(ex):
    ids = tok.encode(ex["text"], add_special_tokens=False).ids + [eot]
    return {"ids": ids, "len": len(ids)}
t = ds.map(process, remove_columns=["text"], num_proc=n)
arr_len = np.sum(t["len"], dtype=np.uint64)
arr = np.memmap(out + "/train.bin", dtype=np.uint16, mode="w+", shape=(arr_len,))
idx = 0
shards = min(1024, len(t))
for i in range(shards):
    batch = t.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
    chunk = np.concatenate(batch["ids"])
    arr[idx:idx + len(chunk)] = chunk
    idx += len(chunk)
arr.flush()
print(int(arr_len))
'''


def make_corpus(path: str, mb: int, seed: int = 0) -> int:
    r = random.Random(seed)
    words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(1, 10))) for _ in range(20000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    docs, size = 0, 0
    with open(path, "w") as f:
        while size < mb * 1_000_000:
            text = " ".join(r.choices(words, weights, k=r.randint(50, 2000)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
            docs += 1
    return docs


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS MB of the child and its children, stdout)."""
    code = ("import resource,subprocess,sys,time;t=time.time();r=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
            "print(time.time()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode);"
            "sys.stderr.write(r.stderr[-2000:]);print(r.stdout[-500:])")
    p = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True)
    first, _, rest = p.stdout.partition("\n")
    secs, rss_kb, rc = first.split()
    if rc != "0":
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    return float(secs), int(rss_kb) / 1024, rest


def host() -> dict:
    flags = []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = sorted(set(line.split(":")[1].split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
                break
    except OSError:
        pass
    import tokenizers

    return {"python": platform.python_version(), "tokenizers": tokenizers.__version__, "cpu_flags": flags,
            "cpus": len(os.sched_getaffinity(0)), "cpu_model": platform.processor() or platform.machine()}


def table(rows: list[dict]) -> str:
    """One line per row; jaxpar's rows give MB/s over nanoGPT's at the same size and workers."""
    lines = [f"{'tool':8} {'MB':>6} {'workers':>7} {'s':>8} {'MB/s':>7} {'peak RSS MB':>12} {'vs nanoGPT':>10}"]
    for r in rows:
        peer = next((p for p in rows if p["tool"] == "nanogpt" and p["mb"] == r["mb"] and p["workers"] == r["workers"]), None)
        ratio = f"{r['mb_s'] / peer['mb_s']:.2f}x" if peer and r["tool"] == "jaxpar" else ""
        lines.append(f"{r['tool']:8} {r['mb']:>6} {r['workers']:>7} {r['s']:>8.1f} {r['mb_s']:>7.2f} "
                     f"{r['peak_rss_mb']:>12.0f} {ratio:>10}")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> dict:
    """Per worker count, jaxpar's: time of the largest corpus over the smallest's (linear: the size
    ratio), its largest peak RSS, and its MB/s over nanoGPT's at each size (absent without a peer)."""
    out = {}
    for w in sorted({r["workers"] for r in rows}):
        by = {r["mb"]: r for r in rows if r["tool"] == "jaxpar" and r["workers"] == w}
        peers = {r["mb"]: r for r in rows if r["tool"] == "nanogpt" and r["workers"] == w}
        lo, hi = min(by), max(by)
        out[f"workers={w}"] = {"time_ratio_largest_to_smallest": by[hi]["s"] / by[lo]["s"], "size_ratio": hi / lo,
                               "peak_rss_mb_max": max(r["peak_rss_mb"] for r in by.values()),
                               "mb_s_vs_nanogpt": {mb: by[mb]["mb_s"] / peers[mb]["mb_s"] for mb in by if mb in peers}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000], help="corpus sizes in MB")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="benchmarks/results/prepare_scale.json")
    ap.add_argument("--no-baseline", action="store_true", help="skip nanoGPT's recipe")
    args = ap.parse_args()
    try:
        import datasets  # noqa: F401

        baseline = not args.no_baseline
    except ImportError:
        baseline = False
        print("nanoGPT's recipe skipped: `pip install datasets` to run it", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from gpt2common import data

        sizes = sorted(args.sizes)
        for mb in sizes:
            docs = make_corpus(f"{tmp}/c{mb}.jsonl", mb)
            if mb == sizes[0]:
                def texts():
                    with open(f"{tmp}/c{mb}.jsonl") as f:
                        for line in f:
                            yield json.loads(line)["text"]
                data.train_bpe(texts()).hf_tokenizer().save(f"{tmp}/tok.json")
            for w in args.workers:
                out = f"{tmp}/j{mb}_{w}"
                s, rss, _ = timed(["jaxpar", "prepare", f"input={tmp}/c{mb}.jsonl", f"out={out}",
                                   f"tokenizer={tmp}/tok.json", f"workers={w}"])
                toks = json.load(open(f"{out}/meta.json"))
                rows.append({"tool": "jaxpar", "mb": mb, "docs": docs, "workers": w, "s": s, "mb_s": mb / s,
                             "peak_rss_mb": rss, "tokens": toks["train_tokens"] + toks["val_tokens"]})
                subprocess.run(["rm", "-rf", out])
                if baseline:
                    nb = f"{tmp}/n{mb}_{w}"
                    os.makedirs(nb)
                    s, rss, outp = timed([sys.executable, "-c", NANOGPT, f"{tmp}/c{mb}.jsonl", f"{tmp}/tok.json", nb, str(w)])
                    rows.append({"tool": "nanogpt", "mb": mb, "docs": docs, "workers": w, "s": s, "mb_s": mb / s,
                                 "peak_rss_mb": rss, "tokens": int(outp.split()[-1])})
                    subprocess.run(["rm", "-rf", nb])
                print(json.dumps(rows[-1]), file=sys.stderr)
            os.remove(f"{tmp}/c{mb}.jsonl")
    print(table(rows))
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host": host(), "rows": rows, "summary": summary,
                   "note": "measured with other jobs possibly running; see benchmarks/README.md"}, f, indent=1)


if __name__ == "__main__":
    main()
