"""Runs CPython regression suites and numpy test files, and returns the
outcome of every test: the same file runs as a node (`fluksio-zygote run`)
and under plain `python3` (its `__main__` block), and tests/fidelity.rs
compares the two test for test."""

import json
import sys
import unittest


class _Outcomes(unittest.TestResult):
    def __init__(self, outcomes):
        super().__init__()
        self.outcomes = outcomes

    def addSuccess(self, test):
        self.outcomes.setdefault(test.id(), "pass")

    def addFailure(self, test, err):
        self.outcomes[test.id()] = "fail"

    def addError(self, test, err):
        self.outcomes[test.id()] = "error"

    def addSkip(self, test, reason):
        self.outcomes[test.id()] = "skip"

    def addExpectedFailure(self, test, err):
        self.outcomes[test.id()] = "xfail"

    def addUnexpectedSuccess(self, test):
        self.outcomes[test.id()] = "xpass"

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.outcomes[subtest.id()] = "fail"


class _Collect:
    """A pytest plugin: each test's outcome, its setup's when that failed."""

    def __init__(self, outcomes):
        self.outcomes = outcomes

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                outcome = "xfail" if report.skipped else "xpass"
            elif report.when != "call" and report.failed:
                outcome = "error"
            else:
                outcome = report.outcome
            self.outcomes.setdefault(report.nodeid, outcome)


def process(suites=(), numpy=()):
    outcomes = {}
    for name in suites:
        tests = unittest.defaultTestLoader.loadTestsFromName(name)
        tests.run(_Outcomes(outcomes))
    if numpy:
        import os

        import numpy as np
        import pytest

        root = os.path.dirname(np.__file__)
        paths = [os.path.join(root, path) for path in numpy]
        pytest.main(["-q", "-p", "no:cacheprovider", *paths], plugins=[_Collect(outcomes)])
    return outcomes


if __name__ == "__main__":
    print(json.dumps(process(**json.loads(sys.argv[1]))))
