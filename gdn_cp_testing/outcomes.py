"""Each test's outcome as it finishes, and a stage's summary line from them (the GPU suite's stages).

A stage of ``benchmarks/gpu_suite.sh`` may be killed at its time limit: pytest then prints no summary.
With ``GDN_CP_TEST_OUTCOMES=FILE`` set, the test session (tests/conftest.py) appends to FILE one JSON
line with every collected test id when collection ends, then one line per test as it finishes (its
outcome: passed, failed, skipped, error), so what ran survives the kill, and
``python3 -m gdn_cp_testing.outcomes FILE`` says ``N passed, N failed, N skipped, N not reached (of N)``
(not reached: collected, with no outcome).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

__all__ = ["OUTCOMES", "record", "summarize"]

OUTCOMES = ("passed", "failed", "error", "skipped")


def record(path: str, **fields) -> None:
    """Append one JSON line to ``path`` (flushed: a killed session keeps it)."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def summarize(path) -> dict:
    """``{"collected": n, outcome: n for each of OUTCOMES, "not_reached": n, "failed_ids": [...]}`` from a
    file :func:`record` wrote (the last outcome of a test wins; a test whose setup failed is an error)."""
    collected: list[str] = []
    last: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if "collected" in entry:
            collected += entry["collected"]
        elif "test" in entry:
            last[entry["test"]] = entry["outcome"]
    counts = Counter(last.values())
    out = {"collected": len(set(collected)), **{o: counts.get(o, 0) for o in OUTCOMES}}
    out["not_reached"] = len(set(collected) - set(last))
    out["failed_ids"] = sorted(t for t, o in last.items() if o in ("failed", "error"))
    return out


def summary_line(summary: dict) -> str:
    return (f"{summary['passed']} passed, {summary['failed']} failed, {summary['error']} errors, "
            f"{summary['skipped']} skipped, {summary['not_reached']} not reached (of {summary['collected']} collected)")


def main(argv: Optional[list[str]] = None) -> int:
    """``python3 -m gdn_cp_testing.outcomes FILE [LABEL]``: the summary line (exit 1 when a test failed or
    was not reached, 2 when FILE is missing)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not Path(argv[0]).is_file():
        print(f"no outcomes file {argv[0] if argv else '(none given)'}: the session did not start", file=sys.stderr)
        return 2
    s = summarize(argv[0])
    label = f"{argv[1]}: " if len(argv) > 1 else ""
    print(f"{label}{summary_line(s)}")
    for t in s["failed_ids"]:
        print(f"  failed: {t}")
    return 1 if s["failed"] or s["error"] or s["not_reached"] else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
