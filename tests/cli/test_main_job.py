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
_REAL_RUN = {"events": [], "answers": None}  # the verbose test's real ranks: what they sent, what they returned


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
def test_named_mode_that_cannot_run_is_refused_before_spawning(monkeypatch, capsys):
    """`gdn-cp run --modes headwise --cp 8` at 4/8 heads: one line, exit 2, no rank spawned; the
    default modes list it as skipped instead (above)."""
    from gdn_cp.cli import main_job

    def no_spawn(*a, **k):
        raise AssertionError("spawned ranks for a job that cannot run")

    monkeypatch.setattr(main_job, "run_ranks", no_spawn)
    assert main(["run", "--modes", "headwise", "--cp", "2,8"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap
    assert cap.err.startswith("gdn-cp run: error: --modes headwise cannot run at --cp 8 with --heads 4,8") and \
        "--heads 8,16" in cap.err, cap.err
    with pytest.raises(ValueError, match="--modes headwise cannot run at --cp 2 with --heads 3,6"):
        check_job(JobConfig(cp_sizes=(2,), modes=("headwise", "chunkwise"), **SMALL))


@pytest.mark.parametrize("argv", [["--cp", "2", "--modes", "chunkwise"], ["--cp", "1,4"], []])
def test_what_every_rank_would_refuse_is_refused_before_spawning(monkeypatch, capsys, argv):
    """Issue #25: `GDN_CP_CHUNKWISE_PATH=native gdn-cp run --cp 2 --modes chunkwise` on a CPU spawned the
    ranks, printed a traceback per rank (43 lines) and exited 1. The parent says it: one line, exit 2."""
    from gdn_cp.cli import main_job

    monkeypatch.setattr(main_job, "run_ranks", lambda *a, **k: pytest.fail("spawned ranks that would all refuse"))
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "native")
    assert main(["run", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1, cap
    assert cap.err.startswith("gdn-cp run: error: chunkwise path 'native' (GDN_CP_CHUNKWISE_PATH): chunkwise at "
                              "--cp ") and "the reference backend has none" in cap.err


def test_the_native_path_runs_where_chunkwise_needs_no_cp(monkeypatch):
    """No refusal where no rank would refuse: chunkwise at CP=1, or not run (--modes without it)."""
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "native")
    check_job(JobConfig(cp_sizes=(1,), modes=("chunkwise",)))
    check_job(JobConfig(cp_sizes=(2, 4), modes=("headwise", "all_gather")))
    with pytest.raises(ValueError, match="chunkwise path 'native'"):
        check_job(JobConfig(cp_sizes=(1, 2)))


def test_fla_refusals_are_said_by_the_parent(monkeypatch):
    """On a GPU machine (stood in here): FLA's head-dim range, a FLA without a cp context under 'native',
    and rows too few for FLA's conv halo are refused before spawning, naming the flag."""
    from gdn_cp.cli import main_job
    from gdn_cp.ops.fla import detect

    fla = dict(backend="fla", device="cuda", dist_backend="nccl", modes=("chunkwise",))
    with pytest.raises(ValueError, match=r"^--backend fla --head-dim 8: head_k_dim=8 is outside what FLA"):
        main_job._check_what_every_rank_checks(JobConfig(**fla, **SMALL))  # noqa: SLF001
    big = dict(SMALL, shape=GDNShape(num_k_heads=3, num_v_heads=6, head_k_dim=16, head_v_dim=16))
    features = detect.FLAFeatures(None, "fla.ops.cp.build_cp_context is not importable (stand-in)")
    monkeypatch.setattr(detect, "features", lambda: features)
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "native")
    with pytest.raises(ValueError, match=r"chunkwise path 'native'.* but FLA .*: fla\.ops\.cp\.build_cp_context "
                                         r"is not importable \(stand-in\)"):
        main_job._check_what_every_rank_checks(JobConfig(cp_sizes=(2,), **fla, **big))  # noqa: SLF001
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "auto")  # auto without a cp context: gdn-cp's own exchange
    main_job._check_what_every_rank_checks(JobConfig(cp_sizes=(2,), **fla, **big))  # noqa: SLF001
    monkeypatch.setattr(detect, "features", lambda: detect.FLAFeatures(None, None))  # a cp context
    few = dict(big, tokens_per_rank=2, num_sequences=1)  # 2 rows per rank, the conv halo needs W-1=3
    with pytest.raises(ValueError, match=r"^--tokens-per-rank 2 --sequences 1 at --cp 2 \(chunkwise through "
                                         r"FLA's cp context\): each rank holds 2 rows"):
        main_job._check_what_every_rank_checks(JobConfig(cp_sizes=(2,), **fla, **few))  # noqa: SLF001
    main_job._check_what_every_rank_checks(JobConfig(cp_sizes=(2,), **fla, **big))  # noqa: SLF001


def test_heads_are_flags_and_in_the_header(monkeypatch):
    """--heads K,V and --head-dim set the core's shape; the header says it before anything runs."""
    from gdn_cp.cli import main_job

    seen = {}

    def fake_run_job(cfg, echo=print, **kw):
        seen["cfg"] = cfg
        return main_job.JobResult()

    monkeypatch.setattr(main_job, "run_job", fake_run_job)
    assert main(["run", "--heads", "2,6", "--head-dim", "16", "--modes", "headwise", "--cp", "2"]) == 0
    assert seen["cfg"].shape == GDNShape(num_k_heads=2, num_v_heads=6, head_k_dim=16, head_v_dim=16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--heads", "4,6"])  # V not a multiple of K: a flag error

    lines = []
    with pytest.raises(ValueError):  # stops in check_job, after nothing was printed
        run_job(JobConfig(cp_sizes=(8,), modes=("headwise",)), echo=lines.append)
    assert lines == []
    header = []
    monkeypatch.setattr(main_job, "run_ranks", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_job(JobConfig(cp_sizes=(2,), num_sequences=1), echo=header.append)
    assert "4 key / 8 value heads of dim 32" in header[0] and "1 packed sequence," in header[0], header[0]


def test_counts_say_one_thing_not_one_things():
    """The report's counted nouns (one case each: "1 sequence", "1 rank", "1 problem")."""
    from gdn_cp.cli import main_job

    lines = []
    result = main_job.JobResult()
    block = main_job._Block(1, (), {}, 1e-5, result, lines.append)  # noqa: SLF001
    block.on_event(0, {"kind": "routes", "cu": [0, 8], "route_summary": "", "route_build_ms": 0.1,
                       "round_trip_exact": True})
    block.on_event(0, {"kind": "reference", "cp1_s": 0.1})
    block.finish([{"plan_hits_after_first": True}])
    main_job._finish(JobConfig(cp_sizes=(1,)), result, lines.append)  # noqa: SLF001
    text = "\n".join(lines)
    assert "packed micro-batch: 1 sequence (lengths 8..8, 0 empty slots)" in text, text
    assert "result: FAIL (1 problem listed above)" in text, text
    assert "1 sequences" not in text and "problem(s)" not in text


def _replaying_ranks(errors: float = 1e-7, seconds: float = 0.25):
    """A stand-in for run_ranks that sends what real ranks send (ctx.emit), rank by rank, at once."""
    def run_ranks(world, fn, cp, cfg, modes, *, on_event, **kw):
        from gdn_cp.layout.packings import packed_boundaries

        cu = packed_boundaries(cfg.num_sequences, cfg.tokens_per_rank * cp, cp, cfg.seed)
        for kind in ("routes", "reference", *modes):
            for rank in range(world):
                if kind == "routes":
                    on_event(rank, {"kind": kind, "cu": cu, "route_summary": "", "route_build_ms": 0.1,
                                    "round_trip_exact": True})
                elif kind == "reference":
                    on_event(rank, {"kind": kind, "cp1_s": 0.5})
                else:
                    on_event(rank, {"kind": "mode", "mode": kind, "seconds": seconds + rank,
                                    "errors": {k: errors * (rank + 1) for k in main_job_columns()}})
        return [{"plan_hits_after_first": True}] * world

    return run_ranks


def main_job_columns():
    from gdn_cp.cli.main_job import COLUMNS

    return COLUMNS


@pytest.mark.slow
def test_each_line_prints_when_its_mode_is_done_and_verbose_shows_every_ranks_log(monkeypatch, caplog):
    """Issue #41: `gdn-cp run` printed nothing for ~100 s after "spawning 2 ranks", then everything at once;
    `-v` changed nothing visible (spawned ranks inherit no logging setup). Each mode's line is printed while
    the ranks still run (before run_ranks returns), and with rank_log_level the ranks' records reach this
    process's loggers, each prefixed with its rank: the THD cut, the route, the mode and backend, and the
    library's own (the chunkwise exchange path); and the default modes skip what cannot run and pass. One run
    for all three (spawning costs seconds)."""
    import logging

    from gdn_cp.cli import main_job

    returned = []
    real = main_job.run_ranks

    def watched(*a, on_event, **k):
        def record(rank, payload):
            _REAL_RUN["events"].append((rank, payload))
            on_event(rank, payload)

        out = real(*a, on_event=record, **k)
        _REAL_RUN["answers"] = out
        returned.append(True)
        return out

    monkeypatch.setattr(main_job, "run_ranks", watched)
    caplog.set_level(logging.DEBUG)
    lines = []
    result = run_job(JobConfig(cp_sizes=(2,), **SMALL), echo=lambda line: lines.append((line, bool(returned))),
                     rank_log_level=logging.DEBUG)
    assert result.exit_code == 0, lines
    rows = {line.split()[0]: done for line, done in lines if line.startswith(("chunkwise ", "all_gather "))}
    assert rows == {"chunkwise": False, "all_gather": False}, lines
    # the default modes: headwise skipped (3 key heads at CP=2), the others pass
    text = "\n".join(line for line, _ in lines)
    assert "relative errors against CP=1" in text
    assert "headwise    skipped: linear_num_key_heads=3 is not divisible by TP*CP=1*2=2" in text
    assert "skipped: headwise at cp=2" in text and "result: PASS" in text and "1 skipped" in text
    for mode in ("chunkwise", "all_gather"):
        row = next(line for line, _ in lines if line.startswith(mode))
        assert row.endswith("yes"), row
    assert result.ran == 2 and result.skipped[0][:2] == (2, "headwise")
    assert [done for line, done in lines if line.startswith("cached plan reused")] == [True]
    messages = [r.getMessage() for r in caplog.records]
    for rank in (0, 1):
        assert any(m.startswith(f"rank {rank}: cp=2: THD cut per_document") and "zigzag->contiguous sends" in m
                   for m in messages), messages
        for mode in ("chunkwise", "all_gather"):
            assert f"rank {rank}: cp=2: {mode} mode on the reference backend (gloo group, cpu)" in messages, messages
        assert any(m.startswith(f"rank {rank}: chunkwise halo/state exchange: generic path") for m in messages)


def test_quiet_prints_only_the_failures_and_the_verdict(monkeypatch, capsys):
    from gdn_cp.cli import main_job

    monkeypatch.setattr(main_job, "run_ranks", _replaying_ranks())
    argv = ["run", "--cp", "2", "--sequences", "5", "--tokens-per-rank", "16", "--heads", "3,6", "--head-dim", "8"]
    assert main([*argv, "-q"]) == 0
    assert capsys.readouterr().out == "result: PASS: 2 (cp, mode) runs that could run passed; 1 skipped (listed above)\n"
    monkeypatch.setattr(main_job, "run_ranks", _replaying_ranks(errors=1.0))
    assert main(["-q", *argv]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "result: FAIL (2 problems listed above)" and len(out) == 3, out
    assert all(line.startswith("failed: cp=2 ") for line in out[:2]), out
    assert main([*argv]) == 1 and "== cp=2: spawning 2 ranks" in capsys.readouterr().out  # without -q: the report
    assert main([*argv, "-q", "-v"]) == 2 and "-v and -q contradict" in capsys.readouterr().err


def test_json_is_the_run_as_one_object_with_the_seed(monkeypatch, capsys):
    """`gdn-cp run --json --seed 3`: stdout is one JSON object: the config (seed included), one row per
    (cp, mode) with its errors (max over ranks) and seconds, the skipped modes, the verdict."""
    import json

    from gdn_cp.cli import main_job

    monkeypatch.setattr(main_job, "run_ranks", _replaying_ranks())
    assert main(["run", "--json", "--seed", "3", "--cp", "2,3", "--sequences", "5", "--tokens-per-rank", "16",
                 "--heads", "3,6", "--head-dim", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["seed"] == 3 and report["config"]["cp_sizes"] == [2, 3] and report["ok"] is True
    assert [(r["cp"], r["mode"]) for r in report["runs"]] == [(2, "chunkwise"), (2, "all_gather"),
                                                              (3, "headwise"), (3, "chunkwise"), (3, "all_gather")]
    row = report["runs"][0]
    assert row["errors"]["out"] == pytest.approx(2e-7) and row["seconds"] == 1.25 and row["ok"] is True  # max of 2 ranks
    assert report["skipped"] == [{"cp": 2, "mode": "headwise", "reason": report["skipped"][0]["reason"]}]
    assert report["blocks"]["2"]["round_trip_exact"] is True and report["blocks"]["3"]["plan_reused"] is True
    assert report["verdict"].startswith("result: PASS: 5 (cp, mode) runs")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--seed", "-1"])


def test_the_seed_chooses_the_packing():
    """--seed reaches the data: another seed, other sequence lengths (and inputs), the same on every rank."""
    from gdn_cp.layout.packings import packed_boundaries

    args = build_parser().parse_args(["run", "--seed", "5"])
    assert args.seed == 5 and build_parser().parse_args(["run"]).seed == 0
    assert packed_boundaries(37, 2048, 2, 0) != packed_boundaries(37, 2048, 2, 5)


@pytest.mark.slow
def test_wrong_answers_fail(monkeypatch):
    """Errors over the tolerance make the exit code 1, with a line saying which (a tolerance no run
    meets: the comparison is not vacuous). The ranks' real events, recorded by the verbose test's run of the
    same job (cp=2, chunkwise among its modes; the parent judges them), are replayed here: no second spawn.
    Run alone, this test spawns its own ranks."""
    if _REAL_RUN["answers"] is not None:
        from gdn_cp.cli import main_job

        def replay(world, fn, cp, cfg, modes, *, on_event, **kw):
            for rank, payload in _REAL_RUN["events"]:
                if payload.get("kind") != "mode" or payload.get("mode") in modes:
                    on_event(rank, payload)
            return _REAL_RUN["answers"]

        monkeypatch.setattr(main_job, "run_ranks", replay)
    lines = []
    result = run_job(JobConfig(cp_sizes=(2,), modes=("chunkwise",), **SMALL), tolerance=-1.0, echo=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 1, text
    assert "failed: cp=2 chunkwise: relative error over -1" in text
    assert "result: FAIL (1 problem listed above)" in text


def test_run_says_that_the_pool_backend_variable_is_not_its_flag(monkeypatch, capsys):
    """Issue #32: GDN_CP_TEST_DIST_BACKEND=nccl was silently ignored by `gdn-cp run` on a CPU; it chooses
    the test rank pools' backend, and the run says that its own is --dist-backend's."""
    from gdn_cp.cli import main
    from gdn_cp.cli import main_job

    ran = []
    monkeypatch.setattr(main_job, "run_job", lambda cfg, **k: ran.append(cfg) or main_job.JobResult())
    monkeypatch.setattr(main_job.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("GDN_CP_TEST_DIST_BACKEND", "nccl")
    assert main(["run"]) == 0 and ran[0].dist_backend == "gloo"
    err = capsys.readouterr().err
    assert err == ("gdn-cp run: note: GDN_CP_TEST_DIST_BACKEND=nccl chooses the backend of the test rank pools; "
                   "gdn-cp run takes --dist-backend (this run: gloo)\n"), err
    monkeypatch.setenv("GDN_CP_TEST_DIST_BACKEND", "gloo")
    assert main(["run"]) == 0 and capsys.readouterr().err == ""


def test_run_refuses_before_spawning_what_would_not_fit_in_memory(monkeypatch):
    """Issue #32: --tokens-per-rank 1048576 (the --help maximum) was OOM-killed after 54 s on a 23 GB machine.
    The estimate (above every peak measured: see main_job's calibration) refuses it before any rank
    starts, with the figures and a --tokens-per-rank that fits every --cp size; the default run fits."""
    import re

    from gdn_cp.cli import main_job
    from gdn_cp.cli.main_job import JobConfig, check_job, estimate_rank_bytes

    monkeypatch.setattr(main_job, "_available_memory", lambda: 23 << 30)
    check_job(JobConfig())  # 1024 tokens per rank at cp 2,4
    with pytest.raises(ValueError) as err:
        check_job(JobConfig(tokens_per_rank=1 << 20))
    msg = str(err.value)
    found = re.fullmatch(r"--tokens-per-rank 1048576 at --cp 2: the 2 ranks would need about ([\d.]+) GiB of memory "
                         r"\(each also computes CP=1 on all T_global=2097152 tokens: ~[\d.]+ GiB\), and this machine "
                         r"has 23\.0 GiB available; use --tokens-per-rank (\d+) or less \(for every --cp size\)", msg)
    assert found and float(found.group(1)) > 100, msg
    fits = int(found.group(2))
    check_job(JobConfig(tokens_per_rank=fits))  # what it names fits at cp 2 and 4
    assert 4 * estimate_rank_bytes(JobConfig(tokens_per_rank=fits + 2), 4) > 23 << 30  # and is the largest
    # measured peaks it must stay above (largest rank's RSS, CPU, float32, 4,8 heads of dim 32)
    for tokens, cp, peak_mib in ((1024, 2, 560), (4096, 2, 1125), (16384, 2, 2703), (2048, 4, 1243)):
        assert estimate_rank_bytes(JobConfig(tokens_per_rank=tokens), cp) > peak_mib << 20
    monkeypatch.setattr(main_job, "_available_memory", lambda: None)  # no /proc/meminfo: not checked
    check_job(JobConfig(tokens_per_rank=1 << 20))
