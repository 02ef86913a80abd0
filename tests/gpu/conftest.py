"""The GPU lane's skip report: where there is no GPU, every test of a file skips for the same reason
(support.gpu.require_gpu, from each file's module fixture); `-rs` then shows one line per file,
at the file, instead of one per test."""

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.skipped and isinstance(rep.longrepr, tuple) and item.get_closest_marker("gpu"):
        rep.longrepr = (str(item.path), 1, rep.longrepr[2])
    return rep
