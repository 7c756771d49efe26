"""The Megatron-LM launcher (gdn_cp_testing.megatron.lm) on the CPU: its command lines pass
Megatron-LM's own parser and ``validate_args`` and give the model config each run means; the SFT
stand-ins feed Megatron-LM's real ``SFTDataset``; the log parser reads Megatron's iteration lines;
``launch`` runs ranks, reads the last rank's log and ends a run whose rank fails; Megatron-LM's own
GPTDataset reads the byte-level text alike at every CP size. The benchmark itself (matrix, verdicts,
budget, resume, plot): tests/megatron/test_train_megatron_lm.py.

The training runs themselves need CUDA and TransformerEngine (the GPU machine:
``GDN_CP_STAGES=train_mlm bash benchmarks/gpu_suite.sh``).
"""

from __future__ import annotations

import json
import platform
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from gdn_cp_testing.megatron.lm import RunSpec, megatron_lm_args, parse_training_log, write_sft_set
from tests.conftest import start_smoke_run

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
    for data in ("sft", "none"):  # every run reads a data folder now: no mock data
        with pytest.raises(ValueError, match=f"RunSpec.data='{data}' needs data_dir"):
            megatron_lm_args(RunSpec("x", data=data))
    with pytest.raises(ValueError, match="RunSpec.iterations=0"):
        RunSpec("x", iterations=0)
    with pytest.raises(ValueError, match="text=b''"):
        write_sft_set("/nonexistent/sft.jsonl", text=b"")


_PARSE = r"""
import argparse, contextlib, dataclasses, hashlib, io, json, os, sys, typing, warnings
warnings.filterwarnings("ignore")
if sys.version_info < (3, 12):
    import typing_extensions
    typing.override = typing_extensions.override
import numpy as np, torch
from gdn_cp_testing import lazy_compile; lazy_compile.install()  # megatron's import without TorchInductor's
import megatron.training.arguments as margs
from megatron.training.arguments import add_megatron_arguments
from megatron.training.argument_utils import core_transformer_config_from_args
import megatron.core.transformer.transformer_config as tc
from megatron.core.extensions.transformer_engine import HAVE_TE
if not torch.cuda.is_available():  # an H200's answers (sm_90): --moe-grouped-gemm asks for the capability
    margs.get_device_arch_version = lambda: 9
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
TMP = os.path.join(os.path.dirname(sys.argv[sys.argv.index("--out") + 1]), "mlm_parse")  # the data, the SFT set
from gdn_cp_testing.megatron import byte_text
from gdn_cp_testing.megatron.lm import RunSpec, VOCAB, _install_sft_stand_ins, megatron_lm_args, write_sft_set
sys.path.insert(0, os.path.dirname(os.environ["GDN_CP_BENCHMARKS"]))  # the repository root: Megatron-LM runs from its checkout
from benchmarks.train_megatron_lm import GROUPS, matrix
from gdn_cp_testing.megatron import wgrads

data_dir = os.path.join(TMP, "data")
with contextlib.redirect_stdout(io.StringIO()):
    out = {"runs": {}, "text": byte_text.build(data_dir)}
parser = add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_hybrid.py"))  # the scripts add no flags
parsed_args = {}
# every run but FlashQLA's, whose backend check wants CUDA and FlashQLA (validated where they are: the GPU machine)
# and the gradient probe's runs (gdn_cp_testing.megatron.wgrads), with its dump flags, named wgrads_*
probe = [(dataclasses.replace(s, name="wgrads_" + s.name, extra_args=s.extra_args + wgrads.dump_args(os.path.join(TMP, s.name))),
          ref and "wgrads_" + ref) for precision in wgrads.PRECISIONS for s, ref in wgrads.runs(precision)]
for spec, ref in [(s, r) for s, r in matrix(GROUPS) if s.backend != "flashqla"] + probe:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(megatron_lm_args(spec, data_dir=data_dir, one_gpu=True))
            args.world_size, args.rank = spec.world, 0
            margs.validate_args(args, {})
            # FP8 with experts: TransformerConfig asks for TE >= 1.7 (the GPU machine has 2.20.2; none here)
            te_version = tc.is_te_min_version
            if spec.fp8 and not HAVE_TE:
                tc.is_te_min_version = lambda *a, **k: True
            try:
                c = core_transformer_config_from_args(args)
            finally:
                tc.is_te_min_version = te_version
            parsed_args[spec.name] = args
            out["runs"][spec.name] = {"mode": c.linear_cp_mode, "cp": c.context_parallel_size, "split": c.linear_cp_thd_split,
                "act": c.activation_func.__name__, "glu": c.gated_linear_unit, "norm": c.normalization,
                "layers": args.num_layers, "backend": args.distributed_backend, "cp_comm": args.cp_comm_type,
                "recompute": [args.recompute_granularity, args.recompute_modules], "pad": args.null_tokenizer_pad_id,
                "warmup": args.seq_length // args.context_parallel_size * args.micro_batch_size * args.ffn_hidden_size,
                "gdn_heads": [c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim], "ref": ref,
                "iterations": args.train_iters, "lr": [args.lr, args.lr_decay_style, args.lr_warmup_iters, args.min_lr],
                "micro_batch": args.micro_batch_size, "hidden": args.hidden_size,
                "pair": [args.bias_swiglu_fusion, args.cross_entropy_loss_fusion, args.accumulate_allreduce_grads_in_fp32],
                "fp8_recipe": c.fp8_recipe if c.fp8 else None,
                "vocab": args.vocab_size, "data_path": args.data_path, "cache": args.data_cache_path,
                "mock": args.mock_data, "sft": args.sft, "params_dtype": str(c.params_dtype), "bf16": args.bf16,
                "samples": args.train_iters * args.global_batch_size,
                "dump": [args.save_wgrads_interval, args.exit_interval, args.save],
                "parallel": {"pp": c.pipeline_model_parallel_size, "ep": c.expert_model_parallel_size,
                             "dp": args.data_parallel_size, "experts": c.num_moe_experts, "mtp": c.mtp_num_layers,
                             "fp8": c.fp8, "dispatcher": c.moe_token_dispatcher_type,
                             "shapes": c.variable_seq_lengths, "pattern": args.hybrid_layer_pattern,
                             "vpp": args.virtual_pipeline_model_parallel_size, "topk": c.moe_router_topk,
                             "grouped_gemm": c.moe_grouped_gemm, "aux": c.moe_aux_loss_coeff,
                             "world": args.world_size}}
        except (ValueError, AssertionError) as e:
            out["runs"][spec.name] = {"error": f"{type(e).__name__}: {e}", "ref": ref}

# the text as each run's own Megatron-LM would read it: pretrain_gpt.py's core_gpt_dataset_config_from_args
# (pretrain_hybrid.py's is the same) on the run's parsed arguments, GPTDataset through the blended builder
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.utils import get_blend_and_blend_per_split


def dataset_config(args):
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, multiple_validation_sets=args.multiple_validation_sets, full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads, path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path, mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=None, defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel, inter_document_masking=args.dataloader_inter_document_masking)


out["text_runs"] = {}
for name in TEXT_RUN_NAMES:  # set by the fixture, above this script
    args = parsed_args[name]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train = BlendedMegatronDatasetBuilder(GPTDataset, [args.train_iters * args.global_batch_size, 0, 0],
                                              lambda: True, dataset_config(args)).build()[0]
    h, docs, top = hashlib.sha256(), [], 0  # the samples the run reads: train_iters x global batch
    for i in range(args.train_iters * args.global_batch_size):
        item = train[i]
        for key in ("tokens", "labels", "loss_mask", "cu_seqlens"):
            if key in item:
                h.update(item[key].numpy().tobytes())
        top = max(top, int(item["tokens"].max()), int(item["labels"].max()))
        if "cu_seqlens" in item:
            cu = item["cu_seqlens"]
            docs.append(np.diff(cu[: int((cu < args.seq_length).sum()) + 1].numpy()).tolist())
    out["text_runs"][name] = {"samples": len(train), "sha256": h.hexdigest(), "top_id": top, "docs": docs,
                              "loss_tokens": int(sum(train[i]["loss_mask"].sum() for i in range(8)))}

# the SFT stand-ins against Megatron-LM's own SFTDataset
_install_sft_stand_ins()
from megatron.training.datasets.sft_dataset import SFTDataset
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers import MegatronTokenizer
tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=VOCAB, pad_id=VOCAB - 2)
corpus = byte_text.corpus_text()
path = write_sft_set(os.path.join(TMP, "sft.jsonl"), text=corpus, rows=6, seq_length=2048)
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
first = out["sft"][1][0]["targets"][:64]
out["sft_targets_in_text"] = corpus.find(bytes(first)) >= 0
with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
    json.dump(out, f)
"""

TEXT_RUNS = {
    # no data flag: both scripts, every CP size, bf16 and fp32, stock's checkout reads the same flags
    "none": ["hybrid_cp1", "hybrid_cp4_chunkwise", "gpt_cp2_headwise", "gdnonly_fp32_cp4_all_gather", "hybrid_cp2_stock"],
    # --dataloader-inter-document-masking: documents reach the rows, the same at every CP size
    "inter_document_masking": ["gpt_idm_cp1", "gpt_idm_cp2", "gpt_idm_cp4", "gdnonly_idm_padded_cp4"],
}


# the script's process (imports megatron.training, builds the text: seconds) starts in the background when the
# session starts (tests/conftest.py), unless the session may patch the installed megatron-core while it runs
SMOKE_RUNS = {"parsed": ("-c", [f"TEXT_RUN_NAMES = {[n for names in TEXT_RUNS.values() for n in names]!r}\n" + _PARSE],
                         {"GDN_CP_BENCHMARKS": str(REPO / "benchmarks")}),
              # the fake Megatron-LM scripts below launched through the launcher, one after the other
              "launched": lambda: ("-c", [_LAUNCH, json.dumps(_SCRIPTS)])}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def parsed(patched_megatron):
    if sys.version_info < (3, 12):
        typing_extensions = pytest.importorskip("typing_extensions", reason="megatron.training needs typing.override")
        if not hasattr(typing_extensions, "override"):
            pytest.skip("Python < 3.12 and typing_extensions without override: megatron.training cannot import")
    code, printed, out = start_smoke_run(sys.modules[__name__], "parsed").result(timeout_s=900)
    assert code == 0 and out.exists(), printed[-6000:]
    return json.loads(out.read_text())


@pytest.mark.megatron
def test_every_run_of_the_matrix_parses_and_validates(parsed):
    runs = parsed["runs"]
    for name, run in runs.items():
        if run["ref"].startswith("refused:"):
            # stops in Megatron-LM's validate_args, before anything is built, naming the flag
            assert run.get("error", "").startswith("ValueError: ") and run["ref"][len("refused:"):] in run["error"], run
            assert "--context-parallel-size 1" in run["error"], run  # ... and the flags that work
            continue
        assert "error" not in run, (name, run)
        # GDN needs SiLU (--swiglu) and the RMSNorm its specs assume
        assert run["act"] == "silu" and run["glu"] and run["norm"] == "RMSNorm", (name, run)
        if run["cp"] > 1:
            assert run["mode"] in ("headwise", "chunkwise", "all_gather"), (name, run)  # auto resolved
            assert run["backend"] == "gloo" and run["cp_comm"] == ["a2a"], (name, run)
        # the byte-level text (or the SFT set cut from it), 50 iterations that the text outlasts (the sweep's tiny
        # model 20), each run its own index cache (runs side by side would race on one); the learning rate as
        # pretraining sets it: warm-up, then cosine decay to a tenth
        sweep = name.startswith("sw_")
        assert not run["mock"] and run["vocab"] == 258 and run["iterations"] == (20 if sweep else 50), (name, run)
        assert run["lr"] == [6e-4, "cosine", 5 if sweep else 10, 6e-5], (name, run)
        assert run["data_path"] == [str(Path(parsed["text"]["path_prefix"]).with_name("sft.jsonl"))
                                    if run["sft"] else parsed["text"]["path_prefix"]], (name, run)
        assert run["cache"].endswith(f"/cache/{name}"), (name, run)
        assert run["samples"] * 4097 < parsed["text"]["tokens"], (name, run)  # no sample read twice
        fp32 = "_fp32_" in name
        assert run["bf16"] is not fp32 and run["params_dtype"] == ("torch.float32" if fp32 else "torch.bfloat16"), run
    ran = [r for r in runs.values() if "cache" in r]  # the refused rows stop before it
    assert len({r["cache"] for r in ran}) == len(ran) == len(runs) - sum(r["ref"].startswith("refused:") for r in runs.values())
    assert runs["hybrid_cp2_headwise"]["mode"] == "headwise" and runs["hybrid_cp2_all_gather"]["mode"] == "all_gather"
    assert runs["gdnonly_idm_cp4"]["split"] == "whole_row" and runs["hybrid_sft_cp2"]["split"] == "per_document"
    # --dataloader-inter-document-masking: attention layers (both scripts) and the GDN-only model asked for it get
    # the padded per-document cut at CP > 1; at CP=1 nothing is cut
    for name in ("hybrid_idm_cp2", "hybrid_idm_cp4", "gpt_idm_cp2", "gpt_idm_cp4", "gdnonly_idm_padded_cp2",
                 "gdnonly_idm_padded_cp4"):
        assert runs[name]["split"] == "per_document", (name, runs[name])
    for name in ("hybrid_idm_cp1", "gpt_idm_cp1", "gdnonly_idm_cp1", "gdnonly_idm_cp2"):
        assert runs[name]["split"] == "whole_row", (name, runs[name])
    assert runs["hybrid_sft_cp2"]["pad"] == 256 and runs["hybrid_sft_cp4"]["sft"]
    # sizes where CP=1 equivalence means something: Megatron-LM's JIT warm-up draws (seq / cp) x micro-batch x FFN
    # elements from the global CUDA generator, which leave it at a CP-dependent offset above ~1M (one Philox round
    # on an H200); GDN head dim 128 and 3 value heads per key head
    for name, run in runs.items():
        if "error" not in run and not name.startswith("sw_"):  # FP8 rows with GDN: dims divisible by 16 (FP8 GEMMs)
            assert run["warmup"] >= 2**21 and run["gdn_heads"] == [4, 8 if name.startswith("par_fp8") else 12, 128], \
                (name, run)
    for prefix in ("hybrid", "gpt", "gdnonly_fp32"):  # every mode at CP=2 and CP=4
        assert {(runs[f"{prefix}_cp{cp}_{m}"]["cp"], runs[f"{prefix}_cp{cp}_{m}"]["mode"]) for cp in (2, 4)
                for m in ("chunkwise", "headwise", "all_gather")} == {(cp, m) for cp in (2, 4)
                                                                    for m in ("chunkwise", "headwise", "all_gather")}
    assert runs["hybrid_cp1"]["layers"] == 6 and runs["gpt_cp1"]["layers"] == 4 and runs["gdnonly_fp32_cp1"]["layers"] == 4
    assert runs["hybrid_full_recompute_cp2"]["recompute"][0] == "full"
    assert runs["gpt_norm_out_recompute_cp2"]["recompute"] == ["selective", ["gdn_norm_out"]]


@pytest.mark.megatron
def test_the_gradient_probe_runs_dump_and_stop_early(parsed):
    """gdn_cp_testing.megatron.wgrads' runs pass Megatron-LM's parser and validate_args with its dump flags: every
    parameter's gradient saved each iteration, an exit after its iterations (the 50-iteration schedule kept), each
    run its own folder; each CP > 1 run against a CP=1 run of its model."""
    from gdn_cp_testing.megatron import wgrads

    probe = {name: run for name, run in parsed["runs"].items() if name.startswith("wgrads_")}
    assert len(probe) == sum(len(wgrads.runs(p)) for p in wgrads.PRECISIONS), probe
    assert all("error" not in run for run in probe.values()), probe
    for name, run in probe.items():
        assert run["dump"][:2] == [1, wgrads.ITERATIONS] and run["dump"][2].endswith(name[len("wgrads_"):]), run
        assert run["iterations"] == 50 and run["lr"] == [6e-4, "cosine", 10, 6e-5], run
        if run["cp"] > 1:
            ref = probe[run["ref"]]
            assert ref["cp"] == 1 and ref["parallel"]["pattern"] == run["parallel"]["pattern"], (name, run, ref)
    assert {run["mode"] for run in probe.values() if run["cp"] > 1} == {"chunkwise", "headwise"}
    assert probe["wgrads_nogdn_cp2"]["parallel"]["pattern"] == "*-*-*-"


@pytest.mark.megatron
def test_the_parallel_rows_are_the_layouts_they_name(parsed):
    """Group ``parallel`` (issue 42) as Megatron-LM's own parser and validate_args make it: pretrain_hybrid.py with
    G, *, E and - layers (4 experts, top-2, alltoall dispatcher, TE's grouped GEMM); each CP > 1 row against the
    same layout at CP=1 (same PP / EP / MTP / FP8 / data, EP folded over 2 data-parallel ranks at CP=1); with
    --dataloader-inter-document-masking the padded per-document cut at CP > 1, and under PP the stages exchange
    shapes (at CP=1 too: micro-batches of 2 samples packed into one row); the refusals stop in validate_args naming their reason."""
    runs = {n: r for n, r in parsed["runs"].items() if n.startswith("par_")}
    assert len(runs) >= 25, sorted(runs)
    for name, run in runs.items():
        if run["ref"].startswith("refused:"):
            continue
        par = run["parallel"]
        assert all(k in par["pattern"] for k in "G*E-") and par["experts"] == 4 and par["topk"] == 2, (name, par)
        assert par["dispatcher"] == "alltoall" and par["grouped_gemm"] and par["vpp"] is None, (name, par)
        assert par["world"] == run["cp"] * par["pp"] * par["dp"], (name, par)
        assert par["pp"] == (2 if "_pp2_" in name else 1) and par["ep"] == (2 if "_ep2_" in name else 1), (name, par)
        assert par["dp"] == (2 if "_ep2_" in name and run["cp"] == 1 else 1), (name, par)
        assert (par["mtp"] == 1) is ("_mtp_" in name) and par["pattern"].endswith("/*E") is ("_mtp_" in name), (name, par)
        assert (par["fp8"] == "hybrid") is ("_fp8" in name) and run["bf16"], (name, par)
        assert run["fp8_recipe"] == ("tensorwise" if "_fp8t_" in name else "delayed" if "_fp8" in name else None), run
        assert par["aux"] == (0.01 if "_aux_" in name else 0.0), (name, par)
        idm = "_idm_" in name
        split = ("per_document" if run["cp"] > 1 else "whole_row") if idm else None
        # the stages exchange shapes where the packed rows change length (the padded cut at CP > 1) or hold a
        # micro-batch of several samples packed into one row (gdn_cp.megatron.packed_pipeline; issue 46)
        shapes = idm and par["pp"] > 1 and (run["cp"] > 1 or run["micro_batch"] > 1)
        assert run["split"] == split and par["shapes"] is shapes, (name, run)
        if run["ref"]:  # the same layout at CP=1: only CP (and the data-parallel ranks EP folds over) differ
            ref = runs[run["ref"]]
            same = {k: v for k, v in par.items() if k not in ("dp", "world", "shapes")}
            assert same == {k: v for k, v in ref["parallel"].items() if k not in ("dp", "world", "shapes")}, (name, ref)
            assert ref["cp"] == 1 and ref["split"] == (split and "whole_row"), (name, ref)
            assert run["cp"] > 1 or name.endswith("_noise"), name
    assert {runs[f"par_pp2_cp2_{m}"]["mode"] for m in ("chunkwise", "headwise", "all_gather")} == \
        {"chunkwise", "headwise", "all_gather"} and runs["par_pp2_cp4_chunkwise"]["mode"] == "chunkwise"
    assert "--moe-aux-loss-coeff 0.01: Megatron's MoE router would count the pad rows" in runs["par_ep2_aux_idm_cp2"]["error"]
    assert "--pipeline-model-parallel-size 2 with 2 virtual stages per rank: Megatron-LM's get_batch hands every " \
           "stage but the first and the last" in runs["par_pp2_vpp_idm_cp2"]["error"]


@pytest.mark.megatron
def test_noise_pairs_change_only_their_perturbation_and_the_sweep_is_every_combination(parsed):
    """Each noise pair is its reference with one perturbation of PAIRS (SwiGLU unfused, micro-batch 1, fused
    cross-entropy; the autotune and gdn-cp-path pairs differ in their environment only), everything else
    as Megatron-LM parses it equal; every model with CP > 1 rows has at least 3 pairs. Group sweep holds PP 1/2 x
    inter-document masking x micro-batch 1/2 x CP 1/2 on the FLA backend (FlashQLA's half validates on the GPU),
    each CP=2 row the layout of its CP=1 row; the FP8 rows of both recipes and the model without GDN layers parse."""
    runs = parsed["runs"]
    # [SwiGLU fused, cross-entropy fused, fp32 gradient accumulation (validate_args: on for every bf16 run)]
    bf16 = {"swiglu": [False, False, True], "ce": [True, True, True], "mbs1": [True, False, True],
            "autotune": [True, False, True], "attn": [True, False, True], "gdncp": [True, False, True]}
    pairs = {n: r for n, r in runs.items() if n.endswith("_noise") and not n.startswith("wgrads_")}  # the matrix's
    for name, run in pairs.items():
        kind = name[len(run["ref"]) + 1:-len("_noise")]
        ref = runs[run["ref"]]
        assert run["pair"][:2] == bf16[kind][:2] and run["pair"][2] is run["bf16"], (name, run["pair"])
        assert run["micro_batch"] == (1 if kind == "mbs1" else ref["micro_batch"]), name
        same = ("lr", "gdn_heads", "layers", "iterations", "hidden", "parallel", "data_path", "split", "fp8_recipe")
        assert {k: run.get(k) for k in same} == {k: ref.get(k) for k in same}, name
    per_ref = {}
    for name in pairs:
        per_ref[runs[name]["ref"]] = per_ref.get(runs[name]["ref"], 0) + 1
    assert min(per_ref.values()) >= 3 and per_ref["hybrid_cp1"] == per_ref["gpt_cp1"] == 5, per_ref
    sweep = {n: r for n, r in runs.items() if n.startswith("sw_fla_") and not n.endswith("_noise")}
    combos = {(r["parallel"]["pp"], r["split"] is not None or r["cp"] == 1 and "_idm_" in n, r["micro_batch"], r["cp"])
              for n, r in sweep.items()}
    assert len(sweep) == 16 and len(combos) == 16, sorted(sweep)
    for name, run in sweep.items():
        assert run["hidden"] == 256 and run["iterations"] == 20 and run["gdn_heads"] == [4, 12, 128], run
        if run["cp"] == 2:
            ref = runs[run["ref"][len("sweep:"):]]
            assert ref["cp"] == 1 and ref["parallel"]["pp"] == run["parallel"]["pp"], name
            assert ref["micro_batch"] == run["micro_batch"] and ("_idm_" in name) is ("_idm_" in ref["ref"] + run["ref"])
    assert runs["fp8_nogdn_cp2"]["parallel"]["pattern"] == "*-*-*-*-" and runs["fp8_nogdn_cp2"]["fp8_recipe"] == "delayed"


@pytest.mark.megatron
def test_the_same_text_reaches_every_cp_size(parsed):
    """Megatron-LM's GPTDataset, configured from each run's parsed arguments as its script does, reads the
    byte-level text: the same tokens, labels, loss masks (and document boundaries) at CP=1, 2 and 4, bf16 and
    fp32, patched and stock; byte ids and EOD only; with --dataloader-inter-document-masking the rows hold
    several documents whose lengths the padded cut must pad."""
    text, runs = parsed["text"], parsed["text_runs"]
    assert text["vocab_size"] == 258 and text["eod"] == 257 and text["tokens"] == text["bytes"] + text["documents"]
    assert text["python"] == platform.python_version() and text["source"] == sysconfig.get_paths()["stdlib"]
    assert 3_000_000 < text["bytes"] <= 4_000_000 and text["files"] > 100 and text["documents"] > 5 * text["files"]
    for flag, names in TEXT_RUNS.items():
        first = runs[names[0]]
        assert first["samples"] >= 200 and first["top_id"] == 257 and first["loss_tokens"] == 8 * 4096, (flag, first)
        assert all(runs[n]["sha256"] == first["sha256"] for n in names), (flag, {n: runs[n]["sha256"] for n in names})
        assert all(runs[n]["docs"] == first["docs"] for n in names), flag
    assert runs["hybrid_cp1"]["sha256"] != runs["gpt_idm_cp1"]["sha256"]  # cu_seqlens hashed for the masking rows
    docs = runs["gpt_idm_cp1"]["docs"]
    lengths = [n for row in docs for n in row]
    assert all(sum(row) == 4096 for row in docs)
    assert len(lengths) >= 2 * len(docs), len(lengths) / len(docs)
    for cp in (2, 4):
        assert sum(n % (2 * cp) != 0 for n in lengths) >= 0.5 * len(lengths), cp


@pytest.mark.megatron
def test_sft_stand_ins_feed_megatrons_sft_dataset(parsed):
    """SFTDataset packs the written conversations (byte-level slices of the text), pads each to 2*cp at
    CP > 1 and masks every non-assistant target; the same tokens are trained at every CP size (no truncation)."""
    sft = parsed["sft"]
    for cp, rows in sft.items():
        for row in rows:
            cu = row["cu"]
            assert cu[0] == 0 and cu[-1] == 2048 and len(cu) >= 3, cu
            if int(cp) > 1:
                assert all((b - a) % (2 * int(cp)) == 0 for a, b in zip(cu[:-1], cu[1:])), (cp, cu)
            assert 0 < row["loss_tokens"] < 2048 and -100 not in row["targets"]
            assert max(row["targets"]) < 256  # bytes: the pad id 256 never a target
    for i in range(len(sft["1"])):
        assert sft["1"][i]["targets"] == sft["2"][i]["targets"] == sft["4"][i]["targets"]
    assert parsed["sft_targets_in_text"]  # the assistant's tokens are the text's bytes


_LAUNCH = """
import dataclasses, json, sys, textwrap
from pathlib import Path
from gdn_cp_testing.megatron.lm import RunSpec, launch
base, out = Path(sys.argv[-1]).parent / "launched", {}
for name, (body, spec, kw) in json.loads(sys.argv[1]).items():
    root = base / name / "mlm"
    root.mkdir(parents=True)
    (root / "pretrain_hybrid.py").write_text(textwrap.dedent(body))
    res = launch(RunSpec(**spec), checkout=root, log_dir=base / name / "logs", data_dir=base / name / "data", gpus=0,
                 timeout_s=900, **kw)  # generous: an interpreter importing megatron on a loaded 2-core machine
    out[name] = {k: v for k, v in dataclasses.asdict(res).items() if k != "spec"}
with open(sys.argv[-1], "w") as f:
    json.dump(out, f)
"""
# fake pretrain_hybrid.py scripts launched as the benchmark launches Megatron-LM's (torchrun, 2 ranks)
_SCRIPTS = {
    "reads_the_last_ranks_log": ("""\
        import os, sys
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert os.environ["LOCAL_RANK"] == "0" and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert "--distributed-backend" in sys.argv and "--cp-comm-type" in sys.argv
        assert sys.argv[sys.argv.index("--data-path") + 1].endswith("/data/stdlib_bytes")
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == "/nonexistent/site-tl"  # RunSpec.site first
        if rank == world - 1:  # the one-GPU shim lands when the script imports Megatron's DDP buffers
            from megatron.core.distributed import param_and_grad_buffer
            assert param_and_grad_buffer._coalescing_manager.__name__ == "_one_by_one"
            # pipeline stages' and MTP's point-to-point transfers of CUDA tensors go through the host
            import torch.distributed as dist
            from gdn_cp_testing.megatron import host_p2p
            assert host_p2p.installed() and dist.isend is host_p2p._REPLACEMENTS["isend"]
            for it in range(1, 21):
                print(f" iteration {it:8d}/      20 | lm loss: {9 - it / 10:.6E} | grad norm: {1 + it / 100:.3f} |")
        """, dict(name="fake", cp=2, mode="chunkwise", site="/nonexistent/site-tl", iterations=20), {}),
    "a_rank_fails": ("""\
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("--dataloader-inter-document-masking with attention layers at context_parallel_size=2")
        time.sleep(600)  # rank 0 would wait for its peer forever
        """, dict(name="fail", cp=2, mode="auto"), {"failure_grace_s": 1.0}),
}

@pytest.fixture(scope="module")
def launched():
    code, printed, out = start_smoke_run(sys.modules[__name__], "launched").result(timeout_s=1200)
    assert code == 0 and out.exists(), printed[-6000:]
    return json.loads(out.read_text())


def test_launch_reads_the_last_ranks_log(launched):
    res = launched["reads_the_last_ranks_log"]
    assert res["status"] == "ok", res["error"]
    assert res["losses"] == [round(9 - it / 10, 6) for it in range(1, 21)] and res["grad_norms"][-1] == 1.2
    assert res["dist_backend"] == "gloo"


def test_launch_ends_a_run_when_a_rank_fails(launched):
    res = launched["a_rank_fails"]
    # the sleeping rank is killed after the grace (1 s here, 5 s by default; plus reaping), not left to its
    # 600 s; measured from the failure, so a loaded machine's slow interpreter start does not count
    assert res["ended_after_failure_s"] is not None and res["ended_after_failure_s"] < 16, res["ended_after_failure_s"]
    assert res["wall_s"] < 600
    assert res["status"] == "refused" and res["error"].startswith("rank 1 (exit code 1): ValueError: --dataloader-inter"), \
        res["error"]


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


def test_a_run_whose_port_was_taken_starts_again(monkeypatch, tmp_path):
    """Runs side by side pick free ports independently; a rank 0 that lost its port to another run is a
    collision, not the run's outcome: the launcher starts the run again on a new port (seen on the GPU:
    ``DistNetworkError ... EADDRINUSE``); any other failure is returned as it is."""
    from gdn_cp_testing.megatron import lm

    import dataclasses
    import types

    taken = lm.RunResult(spec=None, status="refused", losses=[], grad_norms=[], wall_s=1.0,
                         error="rank 0 (exit code 1): torch.distributed.DistNetworkError: ... EADDRINUSE, "
                               "message: address already in use")
    ok = dataclasses.replace(taken, status="ok", losses=[1.0], error="")
    other = dataclasses.replace(taken, error="rank 0 (exit code 1): ValueError: --flag")
    for answers, want, calls in (([taken, ok], ok, 2), ([taken, taken, taken], taken, 3), ([other, ok], other, 1)):
        seen = []
        monkeypatch.setattr(lm, "launch_once", lambda spec, **kw: seen.append(1) or answers[len(seen) - 1])
        spec = types.SimpleNamespace(name="hybrid_cp4_all_gather")
        assert lm.launch(spec, checkout=tmp_path, log_dir=tmp_path) is want and len(seen) == calls
