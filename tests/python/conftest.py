"""TIDE_STRICT_SKIPS=1 (tests/gpu/run.sh on a GPU machine): a skipped test is a failure,
reported with the check's name and the reason it gave, so a GPU run cannot pass by skipping
(no device seen, a missing build, a wrong torch)."""
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
