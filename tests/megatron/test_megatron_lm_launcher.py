"""The Megatron-LM launcher (gdn_cp_testing.megatron.lm) on the CPU: its command lines pass
Megatron-LM's own parser and ``validate_args`` and give the model config each run means; the SFT
stand-ins feed Megatron-LM's real ``SFTDataset``; the log parser reads Megatron's iteration lines;
``launch`` runs ranks, reads the last rank's log and ends a run whose rank fails; the benchmark's
verdicts (benchmarks/train_megatron_lm.py) follow its tolerance rule.

The training runs themselves need CUDA and TransformerEngine (the GPU machine:
``GDN_CP_STAGES=train_mlm bash benchmarks/gpu_suite.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gdn_cp_testing.megatron.lm import RunSpec, launch, megatron_lm_args, parse_training_log

REPO = Path(__file__).resolve().parents[2]

LOG = """\
[2026-12-01 10:00:01] iteration        1/       3 | consumed samples:            2 | elapsed time per iteration (ms): 900.1 | learning rate: 1.500000E-04 | global batch size:     2 | lm loss: 8.375120E+00 | loss scale: 1.0 | grad norm: 3.141 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-12-01 10:00:02] iteration        2/       3 | consumed samples:            4 | lm loss: 8.101000E+00 | grad norm: 2.500 | number of skipped iterations:   0 | number of nan iterations:   0 |
something else
 [2026-12-01 10:00:03] iteration        3/       3 | consumed samples:            6 | lm loss: 7.900000E+00 | grad norm: 2.000 | number of skipped iterations:   1 | number of nan iterations:   0 |
"""


def test_parse_training_log():
    got = parse_training_log(LOG)
    assert got["losses"] == [8.37512, 8.101, 7.9]
    assert got["grad_norms"] == [3.141, 2.5, 2.0]
    assert got["iteration_ms"] == [900.1, None, None]
    assert got["skipped"] == 1 and got["nan"] == 0


def test_run_spec_refuses_bad_fields():
    with pytest.raises(ValueError, match="RunSpec.data='packed'"):
        RunSpec("x", data="packed")
    with pytest.raises(ValueError, match="RunSpec.model"):
        RunSpec("x", model="mamba")
    with pytest.raises(ValueError, match="data_dir"):
        megatron_lm_args(RunSpec("x", data="sft"))


_PARSE = r"""
import argparse, contextlib, io, json, os, sys, typing, warnings
warnings.filterwarnings("ignore")
if sys.version_info < (3, 12):
    import typing_extensions
    typing.override = typing_extensions.override
import numpy as np, torch
import megatron.training.arguments as margs
from megatron.training.arguments import add_megatron_arguments
from megatron.training.argument_utils import core_transformer_config_from_args
if not torch.cuda.is_available():
    margs.get_device_arch_version = lambda: 9
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
from gdn_cp_testing.megatron.lm import RunSpec, VOCAB, _install_sft_stand_ins, megatron_lm_args, write_sft_set
sys.path.insert(0, os.path.dirname(os.environ["GDN_CP_BENCHMARKS"]))  # the repository root: Megatron-LM runs from its checkout
from benchmarks.train_megatron_lm import matrix

out = {"runs": {}}
parser = add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_hybrid.py"))  # the scripts add no flags
for spec, ref in matrix():
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(megatron_lm_args(spec, data_dir="/nonexistent", one_gpu=True))
            args.world_size, args.rank = spec.world, 0
            margs.validate_args(args, {})
            c = core_transformer_config_from_args(args)
            out["runs"][spec.name] = {"mode": c.linear_cp_mode, "cp": c.context_parallel_size, "split": c.linear_cp_thd_split,
                "act": c.activation_func.__name__, "glu": c.gated_linear_unit, "norm": c.normalization,
                "layers": args.num_layers, "backend": args.distributed_backend, "cp_comm": args.cp_comm_type,
                "recompute": [args.recompute_granularity, args.recompute_modules], "pad": args.null_tokenizer_pad_id,
                "warmup": args.seq_length // args.context_parallel_size * args.micro_batch_size * args.ffn_hidden_size,
                "gdn_heads": [c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim], "ref": ref}
        except (ValueError, AssertionError) as e:
            out["runs"][spec.name] = {"error": f"{type(e).__name__}: {e}", "ref": ref}

# the SFT stand-ins against Megatron-LM's own SFTDataset
_install_sft_stand_ins()
from megatron.training.datasets.sft_dataset import SFTDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers import MegatronTokenizer
tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=VOCAB, pad_id=VOCAB - 2)
path = write_sft_set(os.path.join(os.environ["GDN_CP_TMP"], "sft.jsonl"), rows=6, seq_length=2048)
out["sft"] = {}
for cp in (1, 2, 4):
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=2048, blend=None, split="100,0,0", tokenizer=tok,
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False, context_parallel_size=cp)
    low = SFTDataset.build_low_level_dataset(str(path), cfg)
    ds = SFTDataset(low, str(path), np.arange(len(low)), 6, Split.train, cfg)
    rows = []
    for i in range(6):
        item = ds[i]
        cu = item["cu_seqlens"]
        cu = cu[: int((cu < 2048).sum()) + 1].tolist()
        rows.append({"cu": cu, "loss_tokens": int(item["loss_mask"].sum()),
                     "targets": item["labels"][item["loss_mask"] > 0].tolist()})
    out["sft"][cp] = rows

# Megatron-LM's mock data with --dataloader-inter-document-masking, at the matrix's sequence lengths (the
# seed of every run): how many documents a row holds and how long they are
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import MockGPTDataset
out["mock_idm"] = {}
for s in sorted({spec.seq_length for spec, _ in matrix() if spec.data == "inter_document_masking"}):
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=s, blend=None, tokenizer=tok, reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                           inter_document_masking=True, context_parallel_size=2)
    with contextlib.redirect_stdout(io.StringIO()):
        train = BlendedMegatronDatasetBuilder(MockGPTDataset, [20, 0, 0], lambda: True, cfg).build()[0]
    docs = []
    for i in range(20):
        cu = train[i]["cu_seqlens"]
        docs.append(np.diff(cu[: int((cu < s).sum()) + 1].numpy()).tolist())
    out["mock_idm"][s] = docs
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed(patched_megatron, tmp_path_factory):
    if sys.version_info < (3, 12):
        typing_extensions = pytest.importorskip("typing_extensions", reason="megatron.training needs typing.override")
        if not hasattr(typing_extensions, "override"):
            pytest.skip("Python < 3.12 and typing_extensions without override: megatron.training cannot import")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               GDN_CP_BENCHMARKS=str(REPO / "benchmarks"), GDN_CP_TMP=str(tmp_path_factory.mktemp("sft")))
    r = subprocess.run([sys.executable, "-c", _PARSE], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT"):])


@pytest.mark.megatron
def test_every_run_of_the_matrix_parses_and_validates(parsed):
    runs = parsed["runs"]
    for name, run in runs.items():
        if run["ref"].startswith("refused:"):
            # stops in Megatron-LM's validate_args, before anything is built, naming the flag
            assert run.get("error", "").startswith("ValueError: ") and run["ref"][len("refused:"):] in run["error"], run
            assert "--sft" in run["error"], run  # ... and the flags that work
            continue
        assert "error" not in run, (name, run)
        # GDN needs SiLU (--swiglu) and the RMSNorm its specs assume
        assert run["act"] == "silu" and run["glu"] and run["norm"] == "RMSNorm", (name, run)
        if run["cp"] > 1:
            assert run["mode"] in ("headwise", "chunkwise", "all_gather"), (name, run)  # auto resolved
            assert run["backend"] == "gloo" and run["cp_comm"] == ["a2a"], (name, run)
    assert runs["hybrid_cp2_headwise"]["mode"] == "headwise" and runs["hybrid_cp2_all_gather"]["mode"] == "all_gather"
    assert runs["gdnonly_idm_cp4"]["split"] == "whole_row" and runs["hybrid_sft_cp2"]["split"] == "per_document"
    # --dataloader-inter-document-masking: attention layers (both scripts) and the GDN-only model asked for it get
    # the padded per-document cut at CP > 1; at CP=1 nothing is cut
    for name in ("hybrid_idm_cp2", "hybrid_idm_cp4", "gpt_idm_cp2", "gpt_idm_cp4", "gdnonly_idm_padded_cp2",
                 "gdnonly_idm_padded_cp4"):
        assert runs[name]["split"] == "per_document", (name, runs[name])
    for name in ("hybrid_idm_cp1", "gpt_idm_cp1", "gdnonly_idm_cp1", "gdnonly_idm_cp2"):
        assert runs[name]["split"] == "whole_row", (name, runs[name])
    assert runs["hybrid_sft_cp2"]["pad"] == 1022
    # sizes where CP=1 equivalence means something: Megatron-LM's JIT warm-up draws (seq / cp) x micro-batch x FFN
    # elements from the global CUDA generator, which leave it at a CP-dependent offset above ~1M (one Philox round
    # on an H200); GDN head dim 128 and 3 value heads per key head
    for name, run in runs.items():
        if "error" not in run:
            assert run["warmup"] >= 2**21 and run["gdn_heads"] == [4, 12, 128], (name, run)
    assert {runs[f"{m}_cp{cp}_{mode}"]["mode"] for m in ("hybrid", "gpt") for cp in (2, 4)
            for mode in ("chunkwise", "headwise", "all_gather")} == {"chunkwise", "headwise", "all_gather"}
    assert runs["hybrid_cp1"]["layers"] == 6 and runs["gpt_cp1"]["layers"] == 4
    assert runs["hybrid_full_recompute_cp2"]["recompute"][0] == "full"
    assert runs["gpt_norm_out_recompute_cp2"]["recompute"] == ["selective", ["gdn_norm_out"]]


@pytest.mark.megatron
def test_sft_stand_ins_feed_megatrons_sft_dataset(parsed):
    """SFTDataset packs the written conversations, pads each to 2*cp at CP > 1 and masks every
    non-assistant target; the same tokens are trained at every CP size (no truncation)."""
    sft = parsed["sft"]
    for cp, rows in sft.items():
        for row in rows:
            cu = row["cu"]
            assert cu[0] == 0 and cu[-1] == 2048 and len(cu) >= 3, cu
            if int(cp) > 1:
                assert all((b - a) % (2 * int(cp)) == 0 for a, b in zip(cu[:-1], cu[1:])), (cp, cu)
            assert 0 < row["loss_tokens"] < 2048 and -100 not in row["targets"]
    for i in range(len(sft["1"])):
        assert sft["1"][i]["targets"] == sft["2"][i]["targets"] == sft["4"][i]["targets"]


@pytest.mark.megatron
def test_mock_data_rows_hold_documents_the_padded_cut_pads(parsed):
    """The inter-document-masking runs train on Megatron-LM's mock data (documents of 1-4095 tokens,
    cut at the row ends): rows of several documents, most lengths not divisible by 2*cp, so the
    CP > 1 runs really pad and cut per document."""
    for s, rows in parsed["mock_idm"].items():
        lengths = [n for row in rows for n in row]
        assert all(sum(row) == int(s) for row in rows)
        assert len(lengths) >= 1.5 * len(rows), (s, rows)
        for cp in (2, 4):
            assert sum(n % (2 * cp) != 0 for n in lengths) >= len(lengths) / 3, (s, cp, rows)


def _fake_checkout(root: Path, body: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pretrain_hybrid.py").write_text(textwrap.dedent(body))
    return root


def test_launch_reads_the_last_ranks_log(tmp_path):
    body = """\
        import os, sys
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert os.environ["LOCAL_RANK"] == "0" and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert "--distributed-backend" in sys.argv and "--cp-comm-type" in sys.argv
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == "/nonexistent/site-tl"  # RunSpec.site first
        if rank == world - 1:  # the one-GPU shim lands when the script imports Megatron's DDP buffers
            from megatron.core.distributed import param_and_grad_buffer
            assert param_and_grad_buffer._coalescing_manager.__name__ == "_one_by_one"
            for it in range(1, 21):
                print(f" iteration {it:8d}/      20 | lm loss: {9 - it / 10:.6E} | grad norm: {1 + it / 100:.3f} |")
        """
    spec = RunSpec("fake", cp=2, mode="chunkwise", site="/nonexistent/site-tl")
    res = launch(spec, checkout=_fake_checkout(tmp_path / "mlm", body), log_dir=tmp_path / "logs", gpus=0,
                 timeout_s=900)  # generous: an interpreter importing megatron on a loaded 2-core machine
    assert res.status == "ok", res.error
    assert res.losses == [round(9 - it / 10, 6) for it in range(1, 21)] and res.grad_norms[-1] == 1.2
    assert res.dist_backend == "gloo"


def test_launch_ends_a_run_when_a_rank_fails(tmp_path):
    body = """\
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("--dataloader-inter-document-masking with attention layers at context_parallel_size=2")
        time.sleep(600)  # rank 0 would wait for its peer forever
        """
    res = launch(RunSpec("fail", cp=2, mode="auto"), checkout=_fake_checkout(tmp_path / "mlm", body),
                 log_dir=tmp_path / "logs", gpus=0, timeout_s=900, failure_grace_s=1.0)
    # the sleeping rank is killed after the grace (1 s here, 5 s by default; plus reaping), not left to its
    # 600 s; measured from the failure, so a loaded machine's slow interpreter start does not count
    assert res.ended_after_failure_s is not None and res.ended_after_failure_s < 16, res.ended_after_failure_s
    assert res.wall_s < 600
    assert res.status == "refused" and res.error.startswith("rank 1 (exit code 1): ValueError: --dataloader-inter"), res.error


def test_dataset_helpers_are_built_once_before_runs_start(tmp_path, monkeypatch):
    """run_matrix builds Megatron's C++ dataset helpers in each checkout (``make``) before it starts any
    run: runs started side by side on a fresh checkout would race to build them."""
    from benchmarks import train_megatron_lm as bench
    from gdn_cp_testing.megatron.lm import RunResult

    events = []
    for name in ("mlm", "stock"):
        folder = tmp_path / name / "megatron" / "core" / "datasets"
        folder.mkdir(parents=True)
        (folder / "Makefile").write_text(f"default:\n\techo built >> {tmp_path / name / 'made'}\n")

    def fake_launch(spec, *, checkout, **kw):
        events.append(("launch", spec.name, sorted(p.parent.name for p in tmp_path.glob("*/made"))))
        return RunResult(spec=spec, status="ok", losses=[1.0] * spec.iterations, grad_norms=[1.0] * spec.iterations,
                         wall_s=0.0)

    monkeypatch.setattr(bench, "launch", fake_launch)
    args = bench.argparse.Namespace(checkout=str(tmp_path / "mlm"), stock_checkout=str(tmp_path / "stock"),
                                    work=str(tmp_path / "work"), out=str(tmp_path / "out.json"), groups=("main",),
                                    only=["hybrid_cp1", "hybrid_cp2_stock"], budget_s=600, run_timeout_s=60, max_ranks=8,
                                    flashqla_site=None)
    doc = bench.run_matrix(args)
    assert [r["status"] for r in doc["rows"]] == ["ok"] * 3, doc["rows"]
    assert events and all(made == ["mlm", "stock"] for _, _, made in events), events  # built before the first run
    assert (tmp_path / "mlm" / "made").read_text() == "built\n"  # once
    with pytest.raises(RuntimeError, match="dataset helpers"):
        (tmp_path / "mlm" / "megatron" / "core" / "datasets" / "Makefile").write_text("default:\n\tfalse\n")
        bench.build_dataset_helpers(tmp_path / "mlm")


def test_benchmark_verdicts_follow_the_noise_rule():
    from benchmarks import train_megatron_lm as bench

    base = dict(cp=1, mode=None, data="none", recompute="none", status="ok")
    rows = [
        dict(base, name="m_cp1", reference="", losses=[8.0, 7.0], grad_norms=[2.0, 1.0]),
        dict(base, name="m_cp1_noise", reference="m_cp1", losses=[8.008, 7.0], grad_norms=[2.0, 1.0]),  # 1e-3
        dict(base, name="m_cp2_ok", reference="m_cp1", cp=2, losses=[8.02, 7.0], grad_norms=[2.0, 1.0]),  # 2.5e-3
        dict(base, name="m_cp2_bad", reference="m_cp1", cp=2, losses=[8.0, 7.3], grad_norms=[2.0, 1.0]),
        dict(base, name="m_cp2_refused", reference="refused:--flag", cp=2, status="refused", losses=[], grad_norms=[],
             error="rank 0: ValueError: --flag is not supported at CP > 1 with attention layers"),
        dict(base, name="m_cp2_crashed", reference="refused:--flag", cp=2, status="refused", losses=[], grad_norms=[],
             error="rank 0: RuntimeError: something else"),
        dict(base, name="m_cp2_ran", reference="refused:--flag", cp=2),
        dict(base, name="m_cp2_lost", reference="m_cp1", cp=2, status="refused", losses=[], grad_norms=[]),
    ]
    tol = bench.judge(rows)["bf16"]  # rows without a precision are bf16 runs
    # per iteration, 3x the noise pair's running maximum; its grad norms are equal, so the log's floor holds
    assert tol["loss"] == pytest.approx([3e-3, 3e-3]) and tol["grad_norm"] == [bench.PRINT_FLOOR["grad_norm"]] * 2
    verdicts = {r["name"]: r["verdict"] for r in rows}
    assert verdicts == {"m_cp1": "reference", "m_cp1_noise": "noise pair", "m_cp2_ok": "matches CP=1",
                        "m_cp2_bad": "differs from CP=1", "m_cp2_refused": "refused before step 1 (as required)",
                        "m_cp2_crashed": "stopped before step 1, but not by the refusal naming --flag",
                        "m_cp2_ran": "should have been refused", "m_cp2_lost": "did not run (refused)"}


def test_each_precision_has_its_own_tolerance():
    """An fp32 CP run is held to fp32's noise, not to bf16's (which is 40x wider in the GPU runs)."""
    from benchmarks import train_megatron_lm as bench

    base = dict(cp=1, mode=None, data="none", recompute="none", status="ok", grad_norms=[1.0, 1.0])
    rows = [dict(base, name="b_cp1", reference="", losses=[8.0, 7.0]),
            dict(base, name="b_cp1_noise", reference="b_cp1", losses=[8.0, 7.0007]),  # 1e-4
            dict(base, name="f_cp1", reference="", precision="fp32", losses=[8.0, 7.0]),
            dict(base, name="f_cp1_noise", reference="f_cp1", precision="fp32", losses=[8.0, 7.000014]),  # 2e-6
            dict(base, name="f_cp2", reference="f_cp1", precision="fp32", cp=2, losses=[8.0, 7.0007])]
    tols = bench.judge(rows)
    assert tols["bf16"]["loss"] == pytest.approx([1e-5, 3e-4]) and tols["fp32"]["loss"] == pytest.approx([1e-5, 1e-5])
    assert rows[-1]["verdict"] == "differs from CP=1"  # within bf16's tolerance, not fp32's
    assert rows[-1]["first_iteration_over"] == 2


def test_the_tolerance_follows_the_noise_iteration_by_iteration():
    """Two bf16 runs drift apart as training goes: a run that starts farther from CP=1 than the noise
    pairs do is caught at iteration 1, however close it ends (stock megatron-core's CP=2 at real sizes);
    a run that drifts like the noise pairs matches."""
    from benchmarks import train_megatron_lm as bench

    base = dict(cp=1, mode=None, data="none", recompute="none", status="ok", grad_norms=[1.0, 1.0, 1.0, 1.0])
    rows = [dict(base, name="m_cp1", reference="", losses=[8.0, 4.0, 1.0, 0.1]),
            dict(base, name="m_cp1_noise", reference="m_cp1", losses=[8.0001, 4.0, 1.01, 0.11]),  # 1.25e-5 .. 1e-1
            dict(base, name="m_cp2_drifts", reference="m_cp1", cp=2, losses=[8.0002, 4.0001, 1.02, 0.12]),
            dict(base, name="m_cp2_starts_away", reference="stock:m_cp1", cp=2, losses=[8.01, 4.0, 1.0, 0.1])]
    tol = bench.judge(rows)["bf16"]
    assert tol["loss"] == pytest.approx([3.75e-5, 3.75e-5, 3e-2, 3e-1])
    assert rows[2]["verdict"] == "matches CP=1" and rows[2]["first_iteration_over"] is None
    assert rows[3]["verdict"] == "stock: differs from CP=1" and rows[3]["first_iteration_over"] == 1
    assert rows[3]["loss_rel_diff_it1"] == pytest.approx(1.25e-3) and rows[3]["loss_rel_diff"] == pytest.approx(1.25e-3)


def test_error_tail_reads_the_exception_under_torchruns_prefixes():
    from gdn_cp_testing.megatron.lm import _error_tail

    log = textwrap.dedent("""\
        INFO:megatron.core.timers:(min, max) time across ranks (ms):
        [rank1]: Traceback (most recent call last):
        [rank1]:   File "/tmp/megatron-lm/megatron/core/tensor_parallel/layers.py", line 1071, in __init__
        [rank1]:     raise RuntimeError(
        [rank1]:            ^^^^^^^^^^^^
        [rank1]: RuntimeError: ColumnParallelLinear was called with gradient_accumulation_fusion set to True
        [rank0]:[W1201 22:42:17.230521204 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group() was not called
        """)
    assert _error_tail(log) == "RuntimeError: ColumnParallelLinear was called with gradient_accumulation_fusion set to True"


def test_when_imported_patches_at_import_or_at_once(tmp_path, monkeypatch):
    """The launcher's shims wait for the module they patch (a rank imports Megatron only when its
    script does), and patch it before the importer gets it back."""
    from gdn_cp_testing.megatron.lm import when_imported

    (tmp_path / "gdncp_probe_pkg").mkdir()
    (tmp_path / "gdncp_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "gdncp_probe_pkg" / "mod.py").write_text("def f():\n    return 'stock'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("gdncp_probe_pkg", "gdncp_probe_pkg.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    finders = list(sys.meta_path)
    when_imported("gdncp_probe_pkg.mod", lambda m: setattr(m, "f", lambda: "patched"))
    assert "gdncp_probe_pkg.mod" not in sys.modules  # nothing imported yet
    from gdncp_probe_pkg.mod import f

    assert f() == "patched" and sys.meta_path == finders  # the finder removed itself
    when_imported("gdncp_probe_pkg.mod", lambda m: setattr(m, "g", 1))  # already imported: at once
    assert sys.modules["gdncp_probe_pkg.mod"].g == 1 and sys.meta_path == finders
    for name in ("gdncp_probe_pkg", "gdncp_probe_pkg.mod"):
        sys.modules.pop(name, None)
