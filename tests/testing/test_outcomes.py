"""The GPU suite's per-stage summary: each test's outcome recorded as it ends (tests/conftest.py with
GDN_CP_TEST_OUTCOMES), read back as passed / failed / skipped / not reached, also after a time-out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gdn_cp_testing import outcomes
from tests.conftest import start_smoke_run

ROOT = Path(__file__).resolve().parents[2]


# a pytest session of its own (seconds) starts in the background when this session starts (tests/conftest.py),
# recording its outcomes into the smoke run's --out file
SMOKE_RUNS = {"session": ("-c", ["import os, sys, pytest; os.environ['GDN_CP_TEST_OUTCOMES'] = sys.argv[-1]; "
                                 "sys.exit(pytest.main(sys.argv[1:-2]))", "-q", "-p", "no:cacheprovider",
                                 "tests/test_checks.py"])}


@pytest.fixture(scope="module")
def session():
    return start_smoke_run(sys.modules[__name__], "session").result(timeout_s=300)


def test_a_session_records_every_test_as_it_ends(session):
    code, printed, log = session
    assert code == 0, printed[-2000:]
    s = outcomes.summarize(log)
    assert s["collected"] >= 5 and s["passed"] == s["collected"] and s["not_reached"] == 0 and not s["failed_ids"]
    assert f"{s['passed']} passed" in printed


def test_a_killed_session_says_what_was_not_reached(tmp_path, capsys):
    log = tmp_path / "outcomes.jsonl"
    lines = [{"collected": ["a::t1", "a::t2", "a::t3", "a::t4"]},
             {"test": "a::t1", "outcome": "passed"}, {"test": "a::t2", "outcome": "skipped"},
             {"test": "a::t3", "outcome": "error"}]  # the session was killed before t4
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = outcomes.summarize(log)
    assert (s["passed"], s["skipped"], s["error"], s["failed"], s["not_reached"], s["collected"]) == (1, 1, 1, 0, 1, 4)
    assert outcomes.main([str(log), "stage x"]) == 1
    assert "stage x: 1 passed, 0 failed, 1 errors, 1 skipped, 1 not reached (of 4 collected)" in capsys.readouterr().out
    assert outcomes.main([str(tmp_path / "missing.jsonl")]) == 2
