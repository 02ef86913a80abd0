"""benchmarks/prepare_scale.py's report arithmetic on planted rows (no corpus is prepared)."""

from benchmarks import prepare_scale as ps


def _row(tool, mb, w, s, rss):
    return {"tool": tool, "mb": mb, "workers": w, "s": s, "mb_s": mb / s, "peak_rss_mb": rss}


def test_summary_ratios_and_the_table():
    rows = [_row("jaxpar", 100, 1, 20.0, 300), _row("nanogpt", 100, 1, 40.0, 900),
            _row("jaxpar", 1000, 1, 230.0, 310), _row("jaxpar", 100, 2, 12.0, 500)]
    s = ps.summarize(rows)
    assert s["workers=1"] == {"time_ratio_largest_to_smallest": 11.5, "size_ratio": 10.0, "peak_rss_mb_max": 310,
                              "mb_s_vs_nanogpt": {100: 2.0}}
    assert s["workers=2"]["time_ratio_largest_to_smallest"] == 1.0 and s["workers=2"]["mb_s_vs_nanogpt"] == {}
    lines = ps.table(rows).splitlines()
    assert lines[1].split() == ["jaxpar", "100", "1", "20.0", "5.00", "300", "2.00x"]
    assert lines[2].split() == ["nanogpt", "100", "1", "40.0", "2.50", "900"]


def test_the_synthetic_corpus_is_many_documents_of_the_size_asked(tmp_path):
    docs = ps.make_corpus(str(tmp_path / "c.jsonl"), 1)
    size = (tmp_path / "c.jsonl").stat().st_size
    assert 1_000_000 <= size < 1_030_000 and docs == sum(1 for _ in open(tmp_path / "c.jsonl"))
    assert docs > 50
