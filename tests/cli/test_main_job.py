"""``gdn-cp run`` (gdn_cp.cli.main_job + gdn_cp.cli.run): flags, machine checks before spawning, the
report a newcomer reads, and an exit code that says whether what was asked for passed."""

from __future__ import annotations

import pytest
import torch

from gdn_cp.cli import build_parser, main
from gdn_cp.cli.main_job import JobConfig, check_job, run_job
from gdn_cp.modes import GDNShape

# 3 key heads: headwise cannot split them over cp=2 (the others can); small and quick.
SMALL = dict(num_sequences=5, tokens_per_rank=16, shape=GDNShape(num_k_heads=3, num_v_heads=6, head_k_dim=8,
                                                                 head_v_dim=8))


@pytest.mark.parametrize("argv,flag,needle", [
    (["--cp", "0"], "--cp", "must be >= 1"),
    (["--cp", "-1"], "--cp", "must be >= 1"),
    (["--cp", "2,x"], "--cp", "not an integer"),
    (["--cp", "2,,4"], "--cp", "without empty items"),
    (["--cp", "2,2"], "--cp", "listed twice"),
    (["--sequences", "0"], "--sequences", "must be >= 1"),
    (["--sequences", "-3"], "--sequences", "must be >= 1"),
    (["--tokens-per-rank", "0"], "--tokens-per-rank", "must be >= 1"),
    (["--tokens-per-rank", "7"], "--tokens-per-rank", "must be even"),
    (["--modes", "headwise,blockwise"], "--modes", "unknown mode(s) blockwise"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(capsys, argv, flag, needle):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}:" in err and needle in err, err


def test_lists_are_comma_separated_for_cp_and_modes():
    args = build_parser().parse_args(["run", "--cp", "2, 4", "--modes", "chunkwise,all_gather"])
    assert args.cp == (2, 4) and args.modes == ("chunkwise", "all_gather")
    assert build_parser().parse_args(["run"]).modes is None  # default: every mode


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv,needle", [
    (["--device", "cuda"], "--device cuda: torch"),
    (["--dist-backend", "nccl"], "--dist-backend nccl needs --device cuda"),
    (["--backend", "fla", "--device", "cpu"], "--backend fla needs --device cuda"),
])
def test_machine_checks_fail_before_spawning(capsys, argv, needle):
    assert main(["run", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_check_job_names_fields_for_programmatic_use():
    with pytest.raises(ValueError, match="--cp"):
        check_job(JobConfig(cp_sizes=(2, 0)))
    with pytest.raises(ValueError, match="--tokens-per-rank 5"):
        check_job(JobConfig(tokens_per_rank=5))
    with pytest.raises(ValueError, match="--modes"):
        check_job(JobConfig(modes=("blockwise",)))


@pytest.mark.slow
def test_default_modes_skip_what_cannot_run_and_pass():
    lines = []
    result = run_job(JobConfig(cp_sizes=(2,), **SMALL), echo=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 0, text
    assert "relative errors against CP=1" in text
    assert "headwise    skipped: linear_num_key_heads=3 is not divisible by TP*CP=1*2=2" in text
    assert "skipped: headwise at cp=2" in text and "result: PASS" in text and "1 skipped" in text
    for mode in ("chunkwise", "all_gather"):
        row = next(line for line in lines if line.startswith(mode))
        assert row.endswith("yes"), row
    assert result.ran == 2 and result.skipped[0][:2] == (2, "headwise")


@pytest.mark.slow
def test_asked_for_modes_that_cannot_run_and_wrong_answers_fail():
    """Both make the exit code 1, each with its own line: a mode named in --modes that cannot run,
    and errors over the tolerance (a tolerance no run meets: the comparison is not vacuous)."""
    lines = []
    result = run_job(JobConfig(cp_sizes=(2,), modes=("headwise", "chunkwise"), **SMALL), tolerance=-1.0,
                     echo=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 1, text
    assert "failed: headwise at cp=2 was asked for with --modes but cannot run" in text
    assert "failed: cp=2 chunkwise: relative error over -1" in text
    assert "result: FAIL (2 problem(s)" in text
