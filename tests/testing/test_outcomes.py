"""The GPU suite's per-stage summary: each test's outcome recorded as it ends (tests/conftest.py with
GDN_CP_TEST_OUTCOMES), read back as passed / failed / skipped / not reached, also after a time-out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gdn_cp_testing import outcomes

ROOT = Path(__file__).resolve().parents[2]


def test_a_session_records_every_test_as_it_ends(tmp_path):
    log = tmp_path / "outcomes.jsonl"
    env = {**os.environ, "GDN_CP_TEST_OUTCOMES": str(log)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_checks.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    s = outcomes.summarize(log)
    assert s["collected"] >= 5 and s["passed"] == s["collected"] and s["not_reached"] == 0 and not s["failed_ids"]
    assert f"{s['passed']} passed" in run.stdout


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
