"""Two hooks for the GPU run (tests/gpu/run.sh), inert elsewhere:

TIDE_STRICT_SKIPS=1: a skipped test is a failure, reported with the check's name and the
reason it gave, so a GPU run cannot pass by skipping (no device seen, a missing build, a
wrong torch).

TIDE_RESULTS_JSONL=FILE: one JSON line per test result appended to FILE as it comes (a run
killed at its time limit still returns what finished).
"""
import json
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("TIDE_STRICT_SKIPS") == "1" and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in strict mode (TIDE_STRICT_SKIPS=1): {item.nodeid}: {reason}"


def pytest_runtest_logreport(report):
    path = os.environ.get("TIDE_RESULTS_JSONL")
    # The call's result, or a setup / teardown that did not pass; with pytest-xdist this runs
    # in the controller only (the workers' reports arrive there).
    if not path or (report.when != "call" and report.passed) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    line = dict(step="pytest cuda", test=report.nodeid, phase=report.when, outcome=report.outcome,
                seconds=round(report.duration, 2))
    if not report.passed:
        line["message"] = str(report.longrepr)[-2000:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
