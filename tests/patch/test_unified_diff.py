"""The unified-diff reader / writer the patch tool applies its Megatron changes with."""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import pytest

from gdn_cp.patch.unified_diff import (
    DiffError,
    apply_unified_diff,
    make_unified_diff,
    parse_unified_diff,
    split_lines,
)

OLD = "a\nb\n\x0cc\nd\ne"  # a form feed inside a line, no newline at the end
NEW = "z\na\nb\n\x0cc\nD\ne\nf\n"
HAND_WRITTEN = textwrap.dedent(
    """\
    header text is ignored
    --- a/x.py
    +++ b/x.py
    @@ -0,0 +1 @@
    +z
    @@ -3,3 +4,4 @@
     \x0cc
    -d
    -e
    \\ No newline at end of file
    +D
    +e
    +f
    """
)


def test_split_lines_splits_on_newline_only():
    assert split_lines("a\x0cb\r\nc\x1cd") == ["a\x0cb\r\n", "c\x1cd"]
    assert split_lines("") == [] and split_lines("x\n") == ["x\n"]


def test_apply_exact_and_reversible():
    assert apply_unified_diff(OLD, HAND_WRITTEN) == NEW
    assert apply_unified_diff(NEW, HAND_WRITTEN, reverse=True) == OLD


def test_context_mismatch_names_the_file_and_line():
    with pytest.raises(DiffError, match="x.py: the diff's context does not match at line 3"):
        apply_unified_diff(OLD.replace("d\n", "d2\n"), HAND_WRITTEN, name="x.py")
    with pytest.raises(DiffError, match="does not match"):  # applied twice
        apply_unified_diff(NEW, HAND_WRITTEN)


@pytest.mark.parametrize(
    "diff,message",
    [
        ("@@ -1 +1 @@\n-a\n+b\n", "no '--- '"),
        ("--- a/x\n+++ b/x\n", "no hunks"),
        ("--- a/x\n+++ b/x\n@@ -1,2 +1 @@\n-a\n+b\n", "header says 2 and 1"),
        ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n?a\n", "unexpected hunk line"),
        ("--- a/x\n+++ b/x\nrubbish\n", "unexpected line"),
    ],
)
def test_malformed_diffs_are_refused(diff, message):
    with pytest.raises(DiffError, match=message):
        parse_unified_diff(diff)


@pytest.mark.parametrize(
    "old,new",
    [
        (OLD, NEW),
        ("x\n" * 20, "x\n" * 5 + "y\n" + "x\n" * 15),  # repeated context
        ("a\nb\n", "a\nb"),  # newline removed at the end
        ("", "a\n"),
        ("a\n", ""),
        ("\n\n\n", "\n\n"),  # empty lines as context
    ],
)
def test_make_then_apply_roundtrip(old, new):
    diff = make_unified_diff(old, new, "pkg/f.py")
    assert diff.startswith("--- a/pkg/f.py\n+++ b/pkg/f.py\n@@ ")
    assert apply_unified_diff(old, diff) == new
    assert apply_unified_diff(new, diff, reverse=True) == old


def test_make_of_equal_texts_is_empty():
    assert make_unified_diff("a\n", "a\n", "f") == ""


def test_gnu_patch_reads_what_make_writes(tmp_path):
    exe = shutil.which("patch")
    if exe is None:
        pytest.skip("GNU patch is not installed (the Python applier is tested above)")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "f.py").write_text(OLD)
    (tmp_path / "d.patch").write_text("some header\n\n" + make_unified_diff(OLD, NEW, "pkg/f.py"))
    r = subprocess.run([exe, "-p1", "-i", "d.patch"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "pkg" / "f.py").read_text() == NEW
