"""Machine-readable results: what a number was measured on, JSON files and JSON-lines records.

* :func:`machine_info`, :func:`stack_versions` (``gdn-cp selftest``'s, :mod:`gdn_cp.ops.versions`),
  :func:`now_iso`: the context every result row carries (a timing or an error without the machine and versions cannot be compared later);
* :func:`write_json`: one JSON document, replaced atomically (a killed run leaves the old file or
  the new one, never half of one); a list of rows one row a line;
* :class:`JsonlRecorder`: appends one JSON object per line (GPU test records, incremental runs);
  the first row a process writes to a file is a ``"context"`` row with machine and versions;
* :func:`key_heads_in_glue`, :func:`picks_glue_path`: what a committed ``benchmarks/layer_full.py`` row ran, read the
  same way by every test that judges the rows (:data:`REMOVED_GLUE_PATHS`: the paths they name that are gone).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
from pathlib import Path
from typing import Any, Optional

from gdn_cp.ops.versions import stack_versions

__all__ = ["COPY_LEVERS", "HALO_LEVERS", "KEY_HEAD_LEVERS", "REMOVED_GLUE_PATHS", "SCAN_LEVERS", "JsonlRecorder",
           "default_key_heads_in_glue", "ftz_sigmoid", "halo_rows_apart", "key_heads_in_glue", "load_average", "machine_info", "now_iso",
           "picks_glue_path", "scan_branch_masks", "stack_versions", "wide_column_copy", "write_json"]

KEY_HEAD_LEVERS = ("key_heads_by_backend", "key_heads_in_conv")
"""``benchmarks/layer_full.py``'s levers that only switch ``gdn_cp.ops.fused.glue.REPEAT_KEY_HEADS_IN_CONV``: off, and
on (runs 2026-12-06l/o, when off was the default; no longer offered). A row of one is told by
:func:`key_heads_in_glue`."""


COPY_LEVERS = ("wide_copy", "narrow_copy")
"""``benchmarks/layer_full.py``'s levers that only switch ``gdn_cp.ops.fused.split.WIDE_COLUMN_COPY``: on (runs
2026-12-07d/e, when off was the default; no longer offered), and off. A row of one is told by
:func:`wide_column_copy`."""


HALO_LEVERS = ("halo_in_tiles", "halo_apart")
"""``benchmarks/layer_full.py``'s levers that only switch how the conv reads the CP halo
(``gdn_cp.ops.fused.triton_conv``): ``HALO_ROWS_APART`` off (run 2026-12-07q, when on was the default; no longer
offered), and it and ``SCAN_HALO_TAIL`` on (the two move together). A row of one is told by :func:`halo_rows_apart`."""

HALO_APART_RUNS = ("layer_full-20261207-161258",)
"""The layer_full runs whose code had ``HALO_ROWS_APART`` on by default before rows recorded it (run 2026-12-07q:
its rows without the ``halo_in_tiles`` lever ran with the halo apart). Every other row without the field ran with
the halo in every tile, as all code before run 2026-12-07n did."""

SCAN_LEVERS = ("scan_branch", "scan_branch_ftz")
"""``benchmarks/layer_full.py``'s levers that only switch how the backward's scan masks each sequence
(``gdn_cp.ops.fused.triton_conv.SCAN_BRANCH_MASKS`` on) and, the second, the conv's sigmoid too (``FTZ_SIGMOID`` on).
A row of one is told by :func:`scan_branch_masks` and :func:`ftz_sigmoid`."""


REMOVED_GLUE_PATHS = ("triton_taps_per_program", "triton_norm_dz_copy_x_once", "triton_norm_dz_copy_narrow",
                      "triton_norm_dz_copy_norm_pass", "triton_norm_dz_copy_scan_few")
"""Glue paths (``GDN_CP_GLUE``) removed after runs 2026-12-06l-o, the default's scan faster than each that ran, and
``triton_norm_dz_copy_scan_few`` after run 2026-12-07j, not faster in every row (CHANGELOG.md); committed rows still
name some of them."""


def picks_glue_path(lever: str | None) -> bool:
    """Whether a layer_full row's ``lever_off`` only picked its glue path (``glue_<path>``, a path of ``GLUE_PATHS`` or
    :data:`REMOVED_GLUE_PATHS`): such a row is named by its path."""
    from gdn_cp.ops.fused import GLUE_PATHS

    return lever is not None and lever.startswith("glue_") and lever[5:] in (*GLUE_PATHS, *REMOVED_GLUE_PATHS)


def key_heads_in_glue(row: dict) -> bool:
    """Whether a layer_full row's conv wrote q and k at the value heads for its backend (the row's
    ``key_heads_in_glue``; of the rows from before that field, only the ``key_heads_in_conv`` lever rows did)."""
    return row.get("key_heads_in_glue", row.get("lever_off") == KEY_HEAD_LEVERS[1])


def wide_column_copy(row: dict) -> bool:
    """Whether a layer_full row copied the split's gradient groups into in_proj's as 8-byte words (the row's
    ``wide_column_copy``; of the rows from before that field, only the ``wide_copy`` lever rows did)."""
    return row.get("wide_column_copy", row.get("lever_off") == COPY_LEVERS[0])


def halo_rows_apart(row: dict) -> bool:
    """Whether a layer_full row's forward read the halo in launches of its own (the row's ``halo_rows_apart``; of the
    rows from before that field, those of :data:`HALO_APART_RUNS` without the ``halo_in_tiles`` lever)."""
    if row.get("halo_rows_apart") is not None:
        return row["halo_rows_apart"]
    return row.get("run_id") in HALO_APART_RUNS and row.get("lever_off") != HALO_LEVERS[0]


def scan_branch_masks(row: dict) -> bool:
    """Whether a layer_full row's backward scan masked each sequence by branches (the row's ``scan_branch_masks``;
    rows without that field: the rows of the lever ``scan_branch`` (run 2026-12-07v did not keep the field), no
    other: all code before it was off)."""
    if row.get("scan_branch_masks") is not None:
        return row["scan_branch_masks"]
    return row.get("lever_off") == SCAN_LEVERS[0]


def ftz_sigmoid(row: dict) -> bool:
    """Whether a layer_full row's conv took its sigmoid in flush-to-zero approximations (the row's ``ftz_sigmoid``;
    rows without that field: none, all code before it was off)."""
    return bool(row.get("ftz_sigmoid"))


def default_key_heads_in_glue(stack: str | None, backend: str | None) -> bool:
    """What :func:`key_heads_in_glue` is for gdn-cp's default on a row of this ``stack`` (``"fla 0.4.2 + triton
    3.6.0"``) and gdn-cp ``backend``: ``REPEAT_KEY_HEADS_IN_CONV`` where the backend repeats q and k (FLA < 0.5, which
    has no grouped value heads)."""
    from gdn_cp.ops.fused import glue

    fla = re.match(r"fla (\d+)\.(\d+)", stack or "")
    return glue.REPEAT_KEY_HEADS_IN_CONV and backend == "fla" and fla is not None and (int(fla[1]), int(fla[2])) < (0, 5)


def now_iso() -> str:
    """Local time with its UTC offset, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory, OS, load: enough to say what a result was measured on."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "load_average_1_5_15": load_average(),
    }


def write_json(path, obj) -> Path:
    """Write ``obj`` as JSON to ``path`` (creating folders), replacing the file atomically: a list of rows (dicts)
    one row a line, anything else indented. (The rows indented took a quarter more bytes, and every byte of
    ``benchmarks/results/`` travels to the device machine with each call, inside its 64 MiB.)"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        if isinstance(obj, list) and obj and all(isinstance(row, dict) for row in obj):
            f.write("[\n" + ",\n".join(json.dumps(row, default=str) for row in obj) + "\n]")
        else:
            json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


class JsonlRecorder:
    """Append-only JSON lines at ``path`` (None: records nothing, e.g. an unset env variable).

    ``record(kind, **fields)`` writes ``{"kind", "date", **defaults, **fields}``; the first record
    of this process in this file is preceded by a ``{"kind": "context", machine, versions}`` row, unless
    ``context`` is False (another process of the same run writes it: the ranks of one pool share a machine
    and a stack, so one context row says it for all of them).
    """

    def __init__(self, path, *, context: bool = True, **defaults):
        self.path = None if path in (None, "") else Path(path)
        self.defaults = defaults
        self._context_written = not context

    @classmethod
    def from_env(cls, variable: str, *, context: bool = True, **defaults) -> "JsonlRecorder":
        return cls(os.environ.get(variable), context=context, **defaults)

    def _append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def write_context(self) -> None:
        """The context row now, unless it was written (or left to another process): ahead of a barrier, it
        comes before every row the other processes write after it."""
        if self.path is not None and not self._context_written:
            self._append({"kind": "context", "date": now_iso(), "machine": machine_info(),
                          "versions": stack_versions()})
            self._context_written = True

    def record(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        self.write_context()
        self._append({"kind": kind, "date": now_iso(), **self.defaults, **fields})
