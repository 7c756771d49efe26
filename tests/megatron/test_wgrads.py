"""gdn_cp_testing.megatron.wgrads on the CPU: the comparison of two gradient dumps (which parameter moved, by how
much, by layer kind) and the dump's reading. Its runs' command lines pass Megatron-LM's parser:
tests/megatron/test_megatron_lm_launcher.py; the runs themselves: the GPU machine (``GDN_CP_STAGES=wgrads``)."""

from __future__ import annotations

import pytest
import torch

from gdn_cp_testing.megatron import wgrads

NAMES = {"decoder.layers.0.mixer.in_proj.weight": "gdn", "decoder.layers.0.mixer.conv1d.weight": "gdn",
         "decoder.layers.0.mixer.A_log": "gdn", "decoder.layers.0.mixer.out_norm.weight": "gdn",
         "decoder.layers.2.self_attention.linear_qkv.weight": "attention",
         "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": "attention",
         "decoder.layers.1.mlp.linear_fc1.weight": "mlp", "decoder.final_norm.weight": "norm",
         "embedding.word_embeddings.weight": "embedding", "output_layer.weight": "output",
         "decoder.layers.0.self_attention.in_proj.weight": "gdn"}  # GPT's GDN layers sit under self_attention


def test_each_parameter_name_has_its_layer_kind():
    assert {name: wgrads.kind_of(name) for name in NAMES} == NAMES


def test_the_comparison_names_the_parameter_that_moved():
    gen = torch.Generator().manual_seed(0)
    ref = {name: torch.randn(8, 4, generator=gen) for name in NAMES}
    got = {name: t.clone() for name, t in ref.items()}
    got["decoder.layers.0.mixer.conv1d.weight"] *= 1.01  # 1% off
    got["decoder.layers.2.self_attention.linear_qkv.weight"][0, 0] += 1e-4
    c = wgrads.compare(got, ref, top=3)
    assert c["top"][0]["param"] == "decoder.layers.0.mixer.conv1d.weight" and c["top"][0]["rel"] == pytest.approx(0.01)
    assert c["top"][1]["kind"] == "attention" and 0 < c["top"][1]["rel"] < 1e-4
    # a gradient scaled lies along itself; one element moved in 32 of noise barely
    assert c["top"][0]["along"] == pytest.approx(1.0) and abs(c["top"][1]["along"]) < 0.5
    assert 0 < c["along"] < 1
    assert c["largest_by_kind"]["gdn"] == pytest.approx(0.01) and c["largest_by_kind"]["mlp"] == 0.0
    assert len(c["top"]) == 3 and 0 < c["rel"] < 0.01
    assert wgrads.compare(ref, ref)["rel"] == 0.0
    with pytest.raises(ValueError, match="other parameters"):
        wgrads.compare({"a": ref["output_layer.weight"]}, ref)


def test_a_dump_reads_as_megatron_writes_it(tmp_path):
    """Megatron's save_grads: ``{"model_chunk0": {name: tensor}}`` at ``<save>/wgrads/iter_<7 digits>/mp_rank_00.pth``
    (two chunks: names prefixed with their chunk)."""
    path = wgrads.dump_path(tmp_path, 1)
    assert path == tmp_path / "wgrads" / "iter_0000001" / "mp_rank_00.pth"
    path.parent.mkdir(parents=True)
    torch.save({"model_chunk0": {"a": torch.ones(2)}}, path)
    assert list(wgrads.load_dump(path)) == ["a"]
    torch.save({"model_chunk0": {"a": torch.ones(2)}, "model_chunk1": {"a": torch.zeros(2)}}, path)
    assert sorted(wgrads.load_dump(path)) == ["model_chunk0.a", "model_chunk1.a"]


def test_the_summary_says_each_comparison_in_a_line():
    ref = {name: torch.ones(3) for name in NAMES}
    doc = {"compared": {"x vs y @1": wgrads.compare({**ref, "output_layer.weight": torch.full((3,), 2.0)}, ref),
                        "x vs y @2": {"missing": ["/d/wgrads/iter_0000002/mp_rank_00.pth"]}}}
    lines = wgrads.summary(doc).splitlines()
    assert lines[0].startswith("x vs y @1: all ") and "largest output_layer.weight 1.00e+00" in lines[0]
    assert lines[1] == "x vs y @2: no dump (/d/wgrads/iter_0000002/mp_rank_00.pth)"


def test_every_run_is_launched_within_the_ranks_and_compared_with_its_reference(tmp_path, monkeypatch):
    """run_all with a stand-in launcher that writes Megatron's dumps (a CP=2 run's conv gradient 1% off; no dump at
    iteration 3 for one run): side by side within MAX_RANKS ranks, every CP run and the noise pair compared with
    their reference at each iteration, a missing dump said, a launcher that fails kept as the run's row."""
    import threading
    import types

    from gdn_cp_testing.megatron import byte_text, lm

    lock, busy, most = threading.Lock(), [0], [0]

    def launch(spec, *, checkout, log_dir, data_dir, timeout_s, extra_env):
        with lock:
            busy[0] += spec.world
            most[0] = max(most[0], busy[0])
        try:
            if spec.name == "nogdn_cp2":
                raise RuntimeError("no port")
            save = spec.extra_args[spec.extra_args.index("--save") + 1]
            for it in range(1, wgrads.ITERATIONS + (0 if spec.name == "hybrid_idm_cp2" else 1)):
                grads = {name: torch.full((4,), float(it)) for name in NAMES}
                if spec.cp > 1:
                    grads["decoder.layers.0.mixer.conv1d.weight"] *= 1.01
                wgrads.dump_path(save, it).parent.mkdir(parents=True)
                torch.save({"model_chunk0": grads}, wgrads.dump_path(save, it))
            return types.SimpleNamespace(status="ok", losses=[5.0] * 50, grad_norms=[1.0] * 50, error="", wall_s=1.0)
        finally:
            with lock:
                busy[0] -= spec.world

    monkeypatch.setattr(lm, "launch", launch)
    monkeypatch.setattr(byte_text, "build", lambda data_dir: {"tokens": 0})
    doc = wgrads.run_all(tmp_path / "checkout", tmp_path / "work", timeout_s=10, max_ranks=3)
    assert 0 < most[0] <= 3 and set(doc["runs"]) == {s.name for s, _ in wgrads.runs()} and doc["max_ranks"] == 3
    assert doc["runs"]["nogdn_cp2"]["status"] == "failed" and "no port" in doc["runs"]["nogdn_cp2"]["error"]
    c = doc["compared"]
    assert len(c) == wgrads.ITERATIONS * (sum(1 for _, ref in wgrads.runs() if ref) + len(wgrads.ALSO_COMPARED))
    # the SBHD CP runs against CP=1 on gdn-cp's kernels too, a run whose rank processes get the switch
    assert c["hybrid_cp2_chunkwise vs hybrid_cp1_gdn_cp @1"]["top"][0]["rel"] == pytest.approx(0.01)
    assert dict(next(s for s, _ in wgrads.runs() if s.name == "hybrid_cp1_gdn_cp").env) == {
        "GDN_CP_MLM_GDN_CP_AT_CP1": "1"}
    first = c["hybrid_cp2_chunkwise vs hybrid_cp1 @1"]["top"][0]
    assert first["param"] == "decoder.layers.0.mixer.conv1d.weight" and first["rel"] == pytest.approx(0.01)
    assert c["hybrid_cp1_swiglu_noise vs hybrid_cp1 @2"]["rel"] == 0.0
    assert "missing" in c[f"hybrid_idm_cp2 vs hybrid_idm_cp1 @{wgrads.ITERATIONS}"]
    assert "missing" in c["nogdn_cp2 vs nogdn_cp1 @1"]


def test_rounding_noise_lies_across_the_gradient_a_lost_term_along_it():
    """``along`` tells a bias from rounding: noise of any size leaves the difference near-orthogonal to the gradient
    (cosine ~ 1 / sqrt(numel)), a term lost from the gradient points the difference against it."""
    gen = torch.Generator().manual_seed(1)
    ref = {"decoder.layers.0.mixer.in_proj.weight": torch.randn(4096, generator=gen)}
    noisy = {k: v + 0.05 * torch.randn(4096, generator=gen) for k, v in ref.items()}
    lost = {k: 0.97 * v + 1e-3 * torch.randn(4096, generator=gen) for k, v in ref.items()}
    assert abs(wgrads.compare(noisy, ref)["along"]) < 0.05
    assert wgrads.compare(lost, ref)["along"] < -0.9


def test_the_fp32_set_is_the_gdn_only_models_sbhd_runs(tmp_path, monkeypatch):
    """``--precision fp32``: CP=1, its noise pair, gdn-cp's CP=1 path and the SBHD CP=2 runs of the GDN-only model in
    fp32 (TE's attention under CP takes bf16 only), the CP runs compared with the path too."""
    import types

    from gdn_cp_testing.megatron import byte_text, lm

    fp32 = wgrads.runs("fp32")
    assert [s.name for s, _ in fp32] == ["gdnonly_fp32_cp1", "gdnonly_fp32_cp1_swiglu_noise", "gdnonly_fp32_cp1_gdn_cp",
                                         "gdnonly_fp32_cp2_chunkwise", "gdnonly_fp32_cp2_headwise"]
    assert {(s.precision, s.pattern) for s, _ in fp32} == {("fp32", "G-G-")}
    assert {ref for _, ref in fp32} == {"", "gdnonly_fp32_cp1"}

    def launch(spec, *, checkout, log_dir, data_dir, timeout_s, extra_env):
        save = spec.extra_args[spec.extra_args.index("--save") + 1]
        for it in range(1, wgrads.ITERATIONS + 1):
            wgrads.dump_path(save, it).parent.mkdir(parents=True)
            torch.save({"model_chunk0": {"a": torch.full((4,), 1.0 + (spec.mode == "chunkwise"))}},
                       wgrads.dump_path(save, it))
        return types.SimpleNamespace(status="ok", losses=[5.0] * 50, grad_norms=[1.0] * 50, error="", wall_s=1.0)

    monkeypatch.setattr(lm, "launch", launch)
    monkeypatch.setattr(byte_text, "build", lambda data_dir: {"tokens": 0})
    doc = wgrads.run_all(tmp_path / "checkout", tmp_path / "work", timeout_s=10, max_ranks=4, precision="fp32")
    assert doc["precision"] == "fp32" and len(doc["compared"]) == wgrads.ITERATIONS * 6
    assert doc["compared"]["gdnonly_fp32_cp2_chunkwise vs gdnonly_fp32_cp1_gdn_cp @1"]["rel"] == 1.0
    assert doc["compared"]["gdnonly_fp32_cp2_headwise vs gdnonly_fp32_cp1_gdn_cp @1"]["rel"] == 0.0


@pytest.mark.parametrize("printed, ranks", [("81559\n", 8), ("143771\n", 14), ("16384\n", 2), (OSError("none"), 8),
                                            ("N/A\n", 8)])
def test_ranks_side_by_side_follow_the_gpus_memory(monkeypatch, printed, ranks):
    """An H100's 80 GiB: 8 ranks of 9.9 GiB; an H200's: 14 (the 13 ranks in one wave); a small GPU: 2 (a CP=2 run
    needs both at once, else it would wait for ever); nvidia-smi missing or unreadable: MAX_RANKS."""
    import subprocess
    import types

    def run(*args, **kwargs):
        if isinstance(printed, Exception):
            raise printed
        return types.SimpleNamespace(stdout=printed)

    monkeypatch.setattr(subprocess, "run", run)
    assert wgrads.ranks_that_fit() == ranks
    assert wgrads.ranks_that_fit("fp32") == max(2, ranks // 2)  # an fp32 rank takes twice the memory


def test_max_ranks_below_two_is_refused(capsys):
    with pytest.raises(SystemExit):
        wgrads.main(["--checkout", "c", "--work", "w", "--out", "o.json", "--max-ranks", "1"])
    assert "--max-ranks 1" in capsys.readouterr().err


@pytest.mark.parametrize("status, losses, said", [("failed", [6.2] * wgrads.ITERATIONS, "ok"),
                                                  ("failed", [6.2] * (wgrads.ITERATIONS - 1), "failed"),
                                                  ("failed", [6.2, None] + [5.3] * wgrads.ITERATIONS, "failed"),
                                                  ("timeout", [], "timeout"), ("ok", [6.2] * 50, "ok")])
def test_a_run_that_exits_after_its_iterations_is_ok(status, losses, said):
    """The launcher expects the schedule's 50 iterations and calls a run that exits at ITERATIONS (``--exit-interval``)
    failed; wgrads calls it ok when it logged a loss at each of its iterations (run 2026-12-07o's rows all said
    failed)."""
    import types

    assert wgrads.run_status(types.SimpleNamespace(status=status, losses=losses)) == said


def test_the_switch_hands_cp1_sbhd_calls_to_gdn_cps_path(monkeypatch):
    """A rank process with GDN_CP_MLM_GDN_CP_AT_CP1=1 (the launcher's shim) dispatches every GDN call to gdn-cp's path:
    ``should_dispatch`` says True where it says False for CP=1 SBHD otherwise; without the switch nothing changes."""
    import types

    import gdn_cp.megatron.gdn as glue
    from gdn_cp_testing.megatron import lm

    saved = glue.should_dispatch
    state = types.SimpleNamespace(adapter=types.SimpleNamespace(static_cp_group=types.SimpleNamespace(size=lambda: 1)))
    one = types.SimpleNamespace(size=lambda: 1)
    sbhd = types.SimpleNamespace(thd=False)
    try:
        monkeypatch.delenv("GDN_CP_MLM_GDN_CP_AT_CP1", raising=False)
        assert not any("gdn-cp's path" in line for line in lm.install_rank_shims([]))
        assert glue.should_dispatch(state, one, sbhd) is False
        monkeypatch.setenv("GDN_CP_MLM_GDN_CP_AT_CP1", "1")
        assert any("gdn-cp's path" in line for line in lm.install_rank_shims([]))
        assert glue.should_dispatch(state, one, sbhd) is True
    finally:
        glue.should_dispatch = saved
