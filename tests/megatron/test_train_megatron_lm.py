"""benchmarks/train_megatron_lm.py and its verdict (benchmarks/mlm_verdict.py) on the CPU, without launching
Megatron-LM: the band of each model's noise pairs (per iteration, window, K, floor; loss and grad norm), what it
lets through and what it catches, the investigation data of a run that leaves it, the legacy rules of committed
files, the matrix and its groups (pairs of every model, the sweep, FP8), the plan over device calls, a run that
resumes an earlier file, the table and the plot's data.

Its runs' command lines against Megatron-LM's parser, and the text they read:
tests/megatron/test_megatron_lm_launcher.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import mlm_verdict as verdict
from benchmarks import train_megatron_lm as bench
from gdn_cp_testing.megatron.lm import RunResult

ITS = 30
ROOT = Path(__file__).resolve().parents[2]


def falling(start=6.0, step=0.05, n=ITS, scale=1.0):
    """A loss curve that is still learning at its end (and far above 0.5)."""
    return [(start - step * i) * scale for i in range(n)]


def row(name, reference="", *, losses, cp=1, precision="bf16", grad_norms=None, status="ok", model="hybrid", **kw):
    fields = dict(pattern="G-G-*-" if model == "hybrid" else "G-G-*-", hidden=1024, seq_length=4096, gdn_heads=[4, 12],
                  iterations=len(losses) or ITS, lr_decay="cosine")
    return dict(fields, name=name, reference=reference, cp=cp, mode=None, data="none", recompute="none",
                precision=precision, status=status, losses=losses, grad_norms=grad_norms or [2.0] * len(losses),
                model=model, **kw)


def moved(values, rel, at=None):
    """``values`` moved by ``rel`` (relative) at iteration ``at`` (1-based; every iteration when None); ``rel`` may
    be a function of the iteration."""
    f = rel if callable(rel) else (lambda i: rel)
    return [x * (1 + f(i + 1)) if at is None or i + 1 == at else x for i, x in enumerate(values)]


def pairs(ref="m_cp1", sizes=(1e-5, 2e-5, 3e-5), gn=(1e-4, 1e-4, 1e-4), **kw):
    """Three noise pairs of ``ref``, pair k off by ``sizes[k]`` in the loss and ``gn[k]`` in the grad norm at every
    iteration (each may be a function of the iteration)."""
    base = falling()
    return [row(f"{ref}_{kind}_noise", ref, losses=moved(base, s), grad_norms=moved([2.0] * ITS, g), **kw)
            for kind, s, g in zip(("swiglu", "mbs1", "autotune"), sizes, gn)]


# ------------------------------------------------------------------------------------------------
# the band
# ------------------------------------------------------------------------------------------------
def test_the_band_is_k_times_the_largest_pair_difference_near_each_iteration_with_a_floor():
    """band(i) = max(floor, 3 x max over pairs and over iterations i-1..i+1 of |pair - ref| / |ref|): per
    iteration (not a running maximum), loss and grad norm alike."""
    spike = lambda i: 4e-3 if i == 10 else 1e-5  # noqa: E731 - one pair spikes at iteration 10
    rows = [row("m_cp1", losses=falling())] + pairs(sizes=(spike, 2e-6, lambda i: 3e-6 * i), gn=(1e-4, 5e-3, 1e-4))
    tols = verdict.bands(rows)
    (key,) = tols
    loss, gn = tols[key]["loss"], tols[key]["grad_norm"]
    want = [max(1e-5, 3 * max([4e-3 if j == 10 else 1e-5 for j in range(i - 1, i + 2) if 1 <= j <= ITS]
                              + [3e-6 * j for j in range(max(1, i - 1), min(ITS, i + 1) + 1)]))
            for i in range(1, ITS + 1)]
    assert loss == pytest.approx(want, rel=1e-6)
    assert loss[8] == loss[9] == loss[10] == pytest.approx(1.2e-2) and loss[11] < 1e-3  # the spike, +-1 iteration
    assert loss[0] == pytest.approx(3e-5) and gn == pytest.approx([1.5e-2] * ITS)  # 3 x 5e-3 (floor 2e-3 below)
    assert tols[key]["judged"] == ["loss", "grad_norm"] and tols[key]["short"] is None
    assert [p["run"] for p in tols[key]["pairs"]] == ["m_cp1_swiglu_noise", "m_cp1_mbs1_noise", "m_cp1_autotune_noise"]
    floor = verdict.bands([row("m_cp1", losses=falling())] + pairs(sizes=(0.0, 0.0, 0.0), gn=(0.0, 0.0, 0.0)))
    assert set(floor[key]["loss"]) == {1e-5} and set(floor[key]["grad_norm"]) == {2e-3}


def test_a_small_bias_leaves_the_band_where_the_pairs_agree_and_chaos_passes():
    """Pairs that agree to 1e-5 for 15 iterations and then diverge (chaos, 1e-2): a run 1e-3 off from iteration 1
    (a small bias) leaves the band at iteration 1, and its investigation data say where and by how much; a run
    that diverges with the pairs matches; a run beyond 3x the pairs in the chaotic phase leaves it there."""
    chaos = lambda i: 1e-5 if i <= 15 else 1e-2  # noqa: E731
    base = falling()
    rows = [row("m_cp1", losses=base)] + pairs(sizes=(chaos, chaos, chaos)) + [
        row("m_cp2_biased", "m_cp1", cp=2, losses=moved(base, 1e-3)),
        row("m_cp2_chaotic", "m_cp1", cp=2, losses=moved(base, lambda i: 2e-5 if i <= 15 else 2.5e-2)),
        row("m_cp4_beyond", "m_cp1", cp=4, losses=moved(base, lambda i: 2e-5 if i != 20 else 4e-2))]
    bench.judge(rows)
    v = {r["name"]: r for r in rows}
    assert v["m_cp2_chaotic"]["verdict"] == "matches CP=1" and v["m_cp2_chaotic"]["left_band"] == {}
    assert 0.8 < v["m_cp2_chaotic"]["loss_ratio"] < 1.0  # how close it came
    biased = v["m_cp2_biased"]
    assert biased["verdict"] == "differs from CP=1" and biased["first_iteration_over"] == 1
    left = biased["left_band"]["loss"]
    assert left["iteration"] == 1 and left["diff"] == pytest.approx(1e-3) and left["band"] == pytest.approx(3e-5)
    assert left["ratio"] == pytest.approx(1e-3 / 3e-5) and left["iterations_over"] == 14  # 1..14 (15: the window)
    beyond = v["m_cp4_beyond"]["left_band"]["loss"]
    assert v["m_cp4_beyond"]["first_iteration_over"] == 20 and beyond["iterations_over"] == 1
    assert beyond["worst_iteration"] == 20 and beyond["worst_ratio"] == pytest.approx(4e-2 / 3e-2)
    assert bench.not_as_required(rows) == ["m_cp2_biased", "m_cp4_beyond"]


def test_the_grad_norm_is_judged_too():
    base = falling()
    rows = [row("m_cp1", losses=base)] + pairs() + [
        row("m_cp2", "m_cp1", cp=2, losses=base, grad_norms=moved([2.0] * ITS, 0.5, at=7))]
    bench.judge(rows)
    r = rows[-1]
    assert r["verdict"] == "differs from CP=1" and r["first_iteration_over"] == r["grad_norm_first_over"] == 7
    assert r["left_band"]["grad_norm"]["diff"] == pytest.approx(0.5) and "loss" not in r["left_band"]
    assert r["grad_norm_rel_diff"] == pytest.approx(0.5)


def test_each_model_is_judged_on_its_own_pairs_and_needs_three():
    """GPT's pairs are 100x the hybrid's: a hybrid run 5e-3 off differs although GPT's band would let it through;
    a model with 2 pairs that ran judges nothing; FP8 recipes and precisions are models of their own."""
    base = falling()
    rows = ([row("h_cp1", losses=base)] + pairs("h_cp1") + [row("g_cp1", losses=base, model="gpt")]
            + pairs("g_cp1", sizes=(1e-3, 2e-3, 3e-3), model="gpt")
            + [row("h_cp2", "h_cp1", cp=2, losses=moved(base, 5e-3)),
               row("g_cp2", "g_cp1", cp=2, model="gpt", losses=moved(base, 5e-3))])
    rows += [row("q_cp1", losses=base, fp8="hybrid")] + pairs("q_cp1", fp8="hybrid")[:2]
    rows += [row("q_cp2", "q_cp1", cp=2, losses=base, fp8="hybrid"),
             row("t_cp1", losses=base, fp8="hybrid", fp8_recipe="tensorwise")]
    rows += pairs("t_cp1", fp8="hybrid", fp8_recipe="tensorwise") + [
        row("t_cp2", "t_cp1", cp=2, losses=base, fp8="hybrid", fp8_recipe="tensorwise")]
    tols = bench.judge(rows)
    v = {r["name"]: r["verdict"] for r in rows}
    assert v["h_cp2"] == "differs from CP=1" and v["g_cp2"] == "matches CP=1"
    assert v["q_cp2"] == "not judged (2 of the 3 noise pairs of its model ran)" and v["t_cp2"] == "matches CP=1"
    assert len(tols) == 4 and {verdict.numerics(r) for r in rows} == {"bf16", "bf16+fp8", "bf16+fp8-tensorwise"}
    assert "q_cp2" in bench.not_as_required(rows)


def test_references_must_still_be_learning():
    memorised = [6.0 * 0.5 ** i for i in range(ITS)]  # ends near 0: learnt
    flat = [3.0 + 0.01 * (i % 2) for i in range(ITS)]  # no longer falling
    rows = [row("m_cp1", losses=falling()), row("l_cp1", losses=memorised), row("f_cp1", losses=flat)]
    bench.judge(rows)
    assert [r["verdict"] for r in rows] == ["reference", "reference, not learning at the end",
                                            "reference, not learning at the end"]
    assert bench.still_learning(falling()[:15]) == {"ok": False, "why": "15 iterations logged: need 20"}
    with pytest.raises(ValueError, match="rule='loose'"):
        bench.judge(rows, "loose")


def test_refusals_failures_and_the_sweeps_either_or():
    """A row that must be refused; a sweep row that stopped before Megatron's training loop (a refusal at
    configuration time: as the sweep wants) or after it (a failure in step 1: not); a CP=2 sweep row whose CP=1
    row was refused has nothing to be compared with."""
    err = "rank 0 (exit code 1): ValueError: packed (THD) input needs batch 1, got hidden_states of shape (4096, 2, 512)"
    rows = [row("r_cp2", "refused:--flag", cp=2, status="refused", losses=[], error="ValueError: --flag is not allowed"),
            row("r2_cp2", "refused:--flag", cp=2, status="refused", losses=[], error="RuntimeError: other"),
            row("r3_cp2", "refused:--flag", cp=2, losses=falling()),
            row("s_cp1", "sweep:", status="refused", losses=[], error=err, reached_training=False),
            row("s_cp2", "sweep:s_cp1", cp=2, losses=falling()),
            row("t_cp1", "sweep:", status="refused", losses=[], error=err, reached_training=True),
            row("u_cp2", "m_cp1", cp=2, status="refused", losses=[], error="rank 1 (exit code 1): RuntimeError: CUDA out "
                "of memory\nmore"), row("b_cp2", "m_cp1", cp=2, status="not run (budget)", losses=[]),
            row("rb_cp2", "refused:--flag", cp=2, status="not run (budget)", losses=[])]
    bench.judge(rows)
    assert {r["name"]: r["verdict"] for r in rows} == {
        "r_cp2": "refused before step 1 (as required)",
        "r2_cp2": "stopped before step 1, but not by the refusal naming --flag", "r3_cp2": "should have been refused",
        "s_cp1": "refused before step 1 (with its reason)", "s_cp2": "no CP=1 reference",
        "t_cp1": "failed before step 1 (ValueError: packed (THD) input needs batch 1, got hidden_states of shape "
                 "(4096, 2, 512))", "u_cp2": "failed before step 1 (RuntimeError: CUDA out of memory)",
        "b_cp2": "not run (budget)", "rb_cp2": "not run (budget)"}  # a refusal that never started was not refused
    assert rows[3]["refusal"].startswith("ValueError: packed (THD)")
    assert bench.not_as_required(rows) == ["r2_cp2", "r3_cp2", "s_cp2", "t_cp1", "u_cp2", "b_cp2", "rb_cp2"]


def test_the_legacy_rule_judges_the_committed_file():
    """``noise_or_floor`` (benchmarks/results/train_megatron_lm.json): 3x the pooled pairs' running maximum of the
    loss, floored at 2e-3; the grad norm reported, not judged; fp32 at 1e-6 / 1e-4 whatever its noise, one pair
    per precision pooled over every model. A rule no file names is refused."""
    base = dict(grad_norms=[1.0, 1.0, 1.0, 1.0])
    rows = [row("m_cp1", losses=[8.0, 4.0, 1.0, 0.1], **base),
            row("m_cp1_noise", "m_cp1", losses=[8.0001, 4.0, 1.01, 0.11], **base),  # 1.25e-5 .. 1e-1
            row("m_cp2_drifts", "m_cp1", cp=2, losses=[8.0002, 4.0001, 1.02, 0.12], **base),
            row("m_cp2_starts_away", "stock:m_cp1", cp=2, losses=[8.1, 4.0, 1.0, 0.1], **base)]
    tol = bench.judge(rows, "noise_or_floor")["bf16"]
    assert tol["loss"] == pytest.approx([2e-3, 2e-3, 3e-2, 3e-1]) and tol["judged"] == ["loss"]
    assert [r["verdict"] for r in rows] == ["reference, not learning at the end", "noise pair", "matches CP=1",
                                            "stock: differs from CP=1"]
    with pytest.raises(ValueError, match="gone since issue 48"):
        bench.judge(rows, "noise")
    ref = falling()
    rows = [row("f_cp1", losses=ref, precision="fp32"),
            row("f_cp1_noise", "f_cp1", losses=[x * 1.01 for x in ref], precision="fp32"),  # widens nothing
            row("f_cp2", "f_cp1", cp=2, precision="fp32", losses=moved(ref, 1.5e-6, at=1)),
            row("b_cp1", losses=ref), row("b_cp1_noise", "b_cp1", losses=moved(ref, 1e-5, at=1)),
            row("b_cp2", "b_cp1", cp=2, losses=moved(ref, 1.9e-3), grad_norms=moved([2.0] * ITS, 0.5, at=3))]
    tols = bench.judge(rows, "noise_or_floor")
    assert tols["fp32"]["loss"] == [1e-6] + [1e-4] * (ITS - 1) and tols["bf16"]["loss"] == pytest.approx([2e-3] * ITS)
    assert rows[2]["verdict"] == "differs from CP=1" and rows[5]["verdict"] == "matches CP=1"  # grad norm reported
    assert rows[5]["grad_norm_first_over"] == 3


# ------------------------------------------------------------------------------------------------
# the matrix, its groups and the plan
# ------------------------------------------------------------------------------------------------
def test_groups_rows_references_and_the_pairs_of_every_model():
    every = bench.matrix(bench.GROUPS, flashqla_site="/site")
    by = {s.name: (s, ref) for s, ref in every}
    assert len(by) == len(every)  # no name twice
    model = lambda s: verdict.model_key(s.describe())  # noqa: E731
    judged = {}
    for spec, ref in every:  # every reference is a CP=1 run of the same model, layout and data
        base = verdict.base_name(ref)
        if base:
            b = by[base][0]
            assert b.cp == 1 and model(b) == model(spec), spec.name
            assert b.data == spec.data or spec.recompute != "none", spec.name
            layout = ("pp", "ep", "num_experts", "mtp_layers", "mtp_pattern", "fp8", "fp8_recipe", "gdn_heads", "backend")
            assert [getattr(b, k) for k in layout] == [getattr(spec, k) for k in layout], spec.name
            if spec.cp > 1 and not ref.startswith(bench.STOCK):
                judged.setdefault(model(b), []).append(spec.name)
        elif ref and ref != bench.SWEEP:  # a refusal names what stops it
            assert ref.startswith(bench.REFUSED) and len(ref) > len(bench.REFUSED) + 10, spec.name
    pairs_of = {}
    for spec, ref in every:
        if spec.name.endswith("_noise"):
            pairs_of.setdefault(model(by[ref][0]), []).append(spec.name.rsplit("_", 2)[1])
    for key, names in judged.items():  # every model with CP > 1 rows has 3 different pairs (5 for group main's)
        assert len(set(pairs_of.get(key, []))) >= 3 == len(pairs_of[key]) or len(pairs_of[key]) == 5, (key, names)
    main = {(s.model, s.cp, s.mode, s.stock) for s, _ in bench.matrix(("main",))}
    assert {(m, cp, mode, False) for m in ("hybrid", "gpt") for cp in (2, 4) for mode in bench.MODES} < main
    assert [s.name for s, _ in bench.matrix(("main",))][:2] == ["hybrid_cp1", "hybrid_cp1_swiglu_noise"]
    assert all(s.lr_decay == "cosine" and s.lr_warmup in (5, 10) and s.min_lr == 6e-5 for s, _ in every)
    more = [s.name for s, _ in bench.matrix(("more",))]
    assert more[:7] == ["gpt_idm_cp1", "gpt_idm_cp4", "gpt_idm_cp2", "hybrid_sft_cp1", "hybrid_sft_cp2",
                        "hybrid_full_recompute_cp2", "gpt_norm_out_recompute_cp2"]
    with pytest.raises(ValueError, match="groups=\\['diagnose'\\]"):
        bench.matrix(("diagnose",))


def test_the_sweep_and_fp8_groups():
    sweep = bench.matrix(("sweep",), flashqla_site="/site")
    runs = [(s, ref) for s, ref in sweep if not s.name.endswith("_noise")]
    combos = {(s.backend, s.pp, s.data, s.micro_batch, s.cp) for s, _ in runs}
    assert len(runs) == len(combos) == 32 and {s.hidden for s, _ in sweep} == {256}
    assert all(ref.startswith(bench.SWEEP) for _, ref in runs)
    assert {s.backend for s, _ in runs} == {None, "flashqla"} and all(s.site == "/site" for s, _ in runs if s.backend)
    fp8 = {s.name: s for s, _ in bench.matrix(("fp8",))}
    assert {s.fp8_recipe for s in fp8.values()} == {None, "tensorwise"} and fp8["fp8_nogdn_cp2"].pattern == "*-*-*-*-"
    assert not any("mbs1" in n for n in fp8)  # delayed scaling's amax history moves once per micro-batch
    assert {n for n in fp8 if not n.endswith("_noise")} >= {"par_fp8_cp2", "par_fp8_cp4", "par_fp8t_cp2", "par_fp8t_cp4",
                                                             "fp8_nogdn_cp2", "fp8_nogdn_cp4", "par_fp8_idm_cp2"}


def test_a_group_alone_brings_its_references_and_the_pairs_of_their_models():
    todo = bench.with_references(bench.matrix(("more",)), ())
    names = [s.name for s, _ in todo]
    assert len(names) == len(set(names))
    for ref in ("hybrid_cp1", "gpt_cp1"):  # the recompute rows' references and their pairs, before them
        assert names.index(ref) < names.index(f"{ref}_mbs1_noise") < names.index("hybrid_full_recompute_cp2")
    done = ["hybrid_cp1"] + [s.name for s, _ in bench.noise_pairs(bench.RunSpec("hybrid_cp1"), bench.PAIRS_OF["main"])]
    again = [s.name for s, _ in bench.with_references(bench.matrix(("more",)), done)]
    assert not set(done) & set(again) and "gpt_cp1_ce_noise" in again


def test_the_plan_keeps_the_rank_budget_and_the_time_budget_and_splits_into_calls():
    todo = bench.with_references(bench.matrix(("main",)), ())
    steps = bench.plan(todo, max_ranks=14, budget_s=10_000)
    assert all(s["start_s"] is not None for s in steps)
    for t in {s["start_s"] for s in steps}:  # ranks in use at every start
        assert sum(s["world"] for s in steps if s["start_s"] <= t < s["end_s"]) <= 14, t
    short = bench.plan(todo, max_ranks=14, budget_s=300)
    assert all(s["end_s"] <= 300 for s in short if s["end_s"] is not None) and short[0]["start_s"] == 0
    calls, never = bench.split_calls(todo, max_ranks=14, budget_s=415)
    assert never == [] and sorted(s["name"] for c in calls for s in c) == sorted(s.name for s, _ in todo)
    assert all(max(s["end_s"] for s in c) <= 415 for c in calls) and len(calls) == 2
    assert bench.split_calls(todo, max_ranks=2, budget_s=415)[1] == [s.name for s, _ in todo if s.world > 2]


def test_the_ranks_side_by_side_follow_the_gpus_memory():
    """14 bf16 rank processes ran on an H200 and ran out of memory on an H100 (run 2026-12-06c): the default
    fits the GPU (nvidia-smi's totals of both), fp32 rows take twice, and --max-ranks overrides."""
    bf16, fp32 = bench.with_references(bench.matrix(("main",)), ()), bench.with_references(bench.matrix(("fp32",)), ())
    h200, h100 = 143771 / 1024, 81559 / 1024
    assert (bench.ranks_that_fit(h200, bf16), bench.ranks_that_fit(h100, bf16)) == (14, 8)
    assert (bench.ranks_that_fit(h200, fp32), bench.ranks_that_fit(h100, fp32)) == (7, 4)
    assert bench._max_ranks(bench.argparse.Namespace(max_ranks=None), None, bf16) == 8  # no GPU seen: an H100
    assert bench._max_ranks(bench.argparse.Namespace(max_ranks=3), 143771, bf16) == 3


def test_the_docs_list_the_calls_the_plan_makes():
    """docs/performance.md, "Not run yet": each training command's groups and budget give as many calls as the
    docs say (the dry run's split), every call within 9 minutes with the suite's ~60 s around the stage."""
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    section = text[text.index("## Not run yet"):]
    found = re.findall(r"(\d+) calls? of `(?:GDN_CP_SAVE_CACHE=0 )?GDN_CP_STAGES=train_mlm GDN_CP_TRAIN_MLM_TIMEOUT=(\d+) "
                       r"GDN_CP_TRAIN_MLM_ARGS=\"([^\"]+)\" bash benchmarks/gpu_suite.sh`", section)
    assert len(found) == 3, found
    for n, timeout, args in found:
        assert int(timeout) + 60 <= 540, timeout
        words = args.split()
        groups = tuple(words[words.index("--groups") + 1].split(","))
        site = "/site" if "flashqla" in groups else None
        todo = bench.with_references(bench.matrix(groups, site), ())
        todo = [(s, r) for s, r in todo if (s.backend == "flashqla") is (site is not None) or "fp32" in groups]
        # on the H100 plain device calls mostly get (run 2026-12-06f: 14 ranks side by side ran out of memory there)
        ranks = int(words[words.index("--max-ranks") + 1]) if "--max-ranks" in words else \
            bench.ranks_that_fit(bench.H100_GIB, todo)
        calls, never = bench.split_calls(todo, max_ranks=ranks, budget_s=int(timeout) - bench.PREP_S)
        assert never == [] and len(calls) == int(n), (groups, ranks, len(calls), n)


# ------------------------------------------------------------------------------------------------
# running the matrix (Megatron-LM's launch faked): helpers first, the budget, resume
# ------------------------------------------------------------------------------------------------
def _stdlib(root: Path) -> Path:
    """A small stand-in standard library (the benchmark reads any folder of .py files)."""
    for i in range(12):
        (root / f"mod{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"mod{i}.py").write_text(f'"""Module {i}."""\nimport os\n\n\ndef f{i}(x):\n    return x + {i}\n\n\n'
                                         f'class C{i}:\n    pass\n' * 20)
    return root


def _checkout(root: Path, name: str) -> Path:
    folder = root / name / "megatron" / "core" / "datasets"
    folder.mkdir(parents=True)
    (folder / "Makefile").write_text(f"default:\n\techo built >> {root / name / 'made'}\n")
    return root / name


def _args(tmp_path, **kw):
    base = dict(checkout=str(tmp_path / "mlm"), stock_checkout=str(tmp_path / "stock"), work=str(tmp_path / "work"),
                out=str(tmp_path / "out.json"), groups=("main",), only=None, budget_s=600, run_timeout_s=60,
                max_ranks=14, flashqla_site=None, resume=None, text_source=str(tmp_path / "stdlib"), text_bytes=10**6)
    return bench.argparse.Namespace(**{**base, **kw})


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    _stdlib(tmp_path / "stdlib")
    _checkout(tmp_path, "mlm")
    _checkout(tmp_path, "stock")
    launched, saved = [], []

    def fake_launch(spec, *, checkout, data_dir, log_dir, extra_env, **kw):
        made = sorted(p.parent.name for p in tmp_path.glob("*/made"))
        launched.append((spec.name, made, sorted(p.name for p in Path(data_dir).iterdir()), {**extra_env, **dict(spec.env)}))
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        refused = spec.name.startswith("sw_") and spec.pp == 2 and spec.cp == 1 and spec.data != "none"
        (Path(log_dir) / f"{spec.name}.rank0.log").write_text("setup\n" + ("" if refused else "training ...\n"))
        if refused:
            return RunResult(spec=spec, status="refused", losses=[], grad_norms=[], wall_s=1.0,
                             error="rank 0 (exit code 1): ValueError: --pipeline-model-parallel-size 2 with packed rows")
        return RunResult(spec=spec, status="ok", losses=falling(n=spec.iterations), grad_norms=[2.0] * spec.iterations,
                         wall_s=1.0)

    real_write = bench.write_json

    def recording_write(path, doc):
        saved.append([r["name"] for r in doc["rows"]])
        return real_write(path, doc)

    monkeypatch.setattr(bench, "launch", fake_launch)
    monkeypatch.setattr(bench, "write_json", recording_write)
    return launched, saved


@pytest.mark.megatron
def test_run_matrix_builds_data_and_helpers_first_and_writes_a_row_per_run(tmp_path, fake_runs):
    launched, saved = fake_runs
    doc = bench.run_matrix(_args(tmp_path, only=["hybrid_cp1", "hybrid_cp2_stock"]))
    assert sorted(r["name"] for r in doc["rows"]) == sorted([
        "hybrid_cp1", "hybrid_cp1_swiglu_noise", "hybrid_cp1_mbs1_noise", "hybrid_cp1_autotune_noise",
        "hybrid_cp1_ce_noise", "hybrid_cp1_gdncp_noise", "hybrid_cp2_stock"])  # in the order they ended
    # Megatron's helpers built in both checkouts (once) and the text and the SFT set written before any run
    assert all(made == ["mlm", "stock"] for _, made, _, _ in launched), launched
    assert all(files[:4] == ["sft.jsonl", "stdlib_bytes.bin", "stdlib_bytes.idx", "stdlib_bytes.json"]
               for _, _, files, _ in launched), launched
    # only the autotune pair takes FLA's first config, whatever the caller's environment says
    assert {n: env["GDN_CP_TEST_FAST_AUTOTUNE"] for n, _, _, env in launched if "noise" in n} == {
        "hybrid_cp1_swiglu_noise": "0", "hybrid_cp1_mbs1_noise": "0", "hybrid_cp1_autotune_noise": "1",
        "hybrid_cp1_ce_noise": "0", "hybrid_cp1_gdncp_noise": "0"}
    # only the gdncp pair hands CP=1's GDN calls to gdn-cp's path
    assert {n for n, _, _, env in launched if env.get("GDN_CP_MLM_GDN_CP_AT_CP1") == "1"} == {"hybrid_cp1_gdncp_noise"}
    assert [len(s) for s in saved] == [1, 2, 3, 4, 5, 6, 7, 7]  # rewritten after every run, and once at the end
    written = json.loads(Path(tmp_path / "out.json").read_text())
    assert written["rule"] == bench.RULE and written["data"]["files"] == 12 and set(written["pairs"]) == set(bench.PAIRS)
    assert {r["name"]: r["verdict"] for r in written["rows"]}["hybrid_cp2_stock"] == "stock: matches CP=1"
    assert all(r["reached_training"] for r in written["rows"])


@pytest.mark.megatron
def test_run_matrix_fits_the_gpu_and_records_the_memory_it_saw_used(tmp_path, fake_runs, monkeypatch):
    """No --max-ranks: as many ranks as the GPU's memory holds; the JSON keeps the memory used every ~5 s (with the
    ranks and runs running then) and the most any moment used."""
    used = iter(range(1000, 100_000, 1000))
    monkeypatch.setattr(bench, "gpu_memory_mib", lambda field: 81559.0 if field == "total" else float(next(used)))
    doc = bench.run_matrix(_args(tmp_path, only=["hybrid_cp1"], max_ranks=None))
    memory = doc["gpu_memory"]
    assert memory["total_mib"] == 81559.0 and memory["max_ranks"] == 8 and memory["gib_per_rank_assumed"] == 9.9
    assert memory["max_used_mib"] >= 1000 and 0 <= memory["ranks_at_max"] <= 8
    assert memory["samples"] and all(len(s) == 4 and s[2] <= 8 for s in memory["samples"])
    assert max(s[1] for s in memory["samples"]) == memory["max_used_mib"]


@pytest.mark.megatron
def test_a_budget_cut_says_not_run_and_a_second_call_resumes_it(tmp_path, fake_runs):
    launched, _ = fake_runs
    only = ["sw_fla_pp2_idm_mb2", "sw_fla_pp1_sbhd_mb2", "sw_qla_pp1_sbhd_mb2_cp1"]
    # the CP=1 rows and the pairs (~54 s) fit 60 s, the CP=2 rows (~62-66 s) do not start
    first = bench.run_matrix(_args(tmp_path, groups=("sweep",), only=only, budget_s=60))
    status = {r["name"]: r["verdict"] for r in first["rows"]}
    assert status["sw_fla_pp2_idm_mb2_cp1"] == "refused before step 1 (with its reason)"
    assert status["sw_fla_pp1_sbhd_mb2_cp1"] == "reference" and status["sw_fla_pp1_sbhd_mb2_cp1_mbs1_noise"] == "noise pair"
    assert status["sw_fla_pp2_idm_mb2_cp2"] == status["sw_fla_pp1_sbhd_mb2_cp2"] == "not run (budget)"
    assert status["sw_qla_pp1_sbhd_mb2_cp1"] == "not run (no --flashqla-site)"
    launched.clear()
    second = bench.run_matrix(_args(tmp_path, groups=("sweep",), only=only, resume=str(tmp_path / "out.json"),
                                    out=str(tmp_path / "out2.json")))
    # only what did not finish as it should (a refusal the sweep allows is kept)
    assert sorted(n for n, _, _, _ in launched) == ["sw_fla_pp1_sbhd_mb2_cp2", "sw_fla_pp2_idm_mb2_cp2"]
    status = {r["name"]: r["verdict"] for r in second["rows"]}
    assert status["sw_fla_pp1_sbhd_mb2_cp2"] == "matches CP=1" and status["sw_fla_pp2_idm_mb2_cp2"] == "no CP=1 reference"
    assert second["resumed_from"]["rows"] == 5
    # rows of another stack are not mixed in, nor rows of other data (another text, another .bin)
    earlier = json.loads((tmp_path / "out2.json").read_text())
    earlier["versions"]["fla"] = "0.0.1"
    (tmp_path / "other.json").write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="its rows ran on another stack \\(fla: 0.0.1 there"):
        bench.run_matrix(_args(tmp_path, only=only, resume=str(tmp_path / "other.json"), out=str(tmp_path / "o4.json")))
    (tmp_path / "stdlib" / "mod0.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="its rows trained on data with .bin sha256"):
        bench.run_matrix(_args(tmp_path, only=only, resume=str(tmp_path / "out.json"), out=str(tmp_path / "o3.json")))
    # a file of an earlier rule: none of its rows is kept (another schedule, fewer pairs)
    (tmp_path / "old.json").write_text(json.dumps(dict(earlier, rule="noise_or_floor")))
    assert bench.load_resume(tmp_path / "old.json")["rows"] == [] == bench.load_resume(tmp_path / "none.json")["rows"]
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "train_curve", "rows": []}))
    with pytest.raises(ValueError, match="not a train_megatron_lm result"):
        bench.load_resume(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------------
# the table and the plot
# ------------------------------------------------------------------------------------------------
def _doc() -> dict:
    ref = falling()
    rows = ([row("m_cp1", losses=ref)] + pairs(sizes=(1e-5, 1e-4, 2e-5))
            + [row("m_cp2_chunkwise", "m_cp1", cp=2, losses=[x * (1 + 1e-5 * i) for i, x in enumerate(ref)]),
               row("m_cp2_stock", "stock:m_cp1", cp=2, losses=[x * 1.005 for x in ref]),
               row("m_cp4_headwise", "m_cp1", cp=4, losses=moved(ref, 2e-3, at=5)),
               row("m_cp4_budget", "m_cp1", cp=4, status="not run (budget)", losses=[])])
    return {"benchmark": "train_megatron_lm", "date": "2026-12-04T10:00:00+00:00", "rule": bench.RULE,
            "versions": {"gpu": "NVIDIA H200"}, "data": {"python": "3.12.3", "files": 220, "documents": 2359,
                                                         "tokens": 3986399, "bin_sha256": "ab" * 32}, "rows": rows}


def test_plot_panels_show_each_runs_difference_against_its_band():
    doc = _doc()
    tols = bench.judge(doc["rows"], doc["rule"])
    (panel,) = bench.plot_panels(doc, tols)
    assert [r["name"] for r in panel["runs"]] == ["m_cp1_swiglu_noise", "m_cp1_mbs1_noise", "m_cp1_autotune_noise",
                                                  "m_cp2_chunkwise", "m_cp2_stock", "m_cp4_headwise"]
    assert panel["tolerance"] == pytest.approx([3e-4] * ITS)
    grows = panel["runs"][3]["diff"]
    assert grows[0] == 1e-8 and grows[-1] == pytest.approx(1e-5 * (ITS - 1), rel=1e-6)  # floored for the log axis


def test_plot_command_prints_the_table_and_draws_the_png(tmp_path, capsys):
    path = tmp_path / "train_megatron_lm.json"
    path.write_text(json.dumps(_doc()))
    assert bench.main(["--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "data: Python 3.12.3 standard library, byte-level: 220 files" in out
    assert re.search(r"m_cp2_chunkwise .* matches CP=1", out) and re.search(r"m_cp4_headwise .* 6\.67 +5 .* differs", out)
    assert re.search(r"m_cp2_stock .* stock: differs from CP=1", out) and "not run (budget)" in out
    assert "(rule pairs_band, judged: loss, grad_norm): loss 3.0e-04 at iteration 1" in out
    pytest.importorskip("matplotlib")
    assert path.with_suffix(".png").stat().st_size > 10_000
