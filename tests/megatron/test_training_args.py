"""Megatron-LM's training command line with the patch: ``--linear-cp-mode`` and ``--linear-cp-backend``
take gdn-cp's names (the patched fields are plain strings, so the patch names no mode and no backend),
a typo fails in ``validate_args`` with gdn-cp's message naming every choice, and ``--linear-cp-mode
auto`` reaches the model config as a concrete mode;
``validate_args`` sets ``--linear-cp-thd-split`` from the data flags that choose the THD cut
(``--dataloader-inter-document-masking``, ``--sft``) and the model's layers (``per_document``, the
padded cut, for ``--dataloader-inter-document-masking`` at CP > 1 in a model with attention layers,
with ``--calculate-per-token-loss``) and refuses a contradicting value, a GDN model without
``--swiglu`` (GDN computes SiLU) and the padded cut without per-token loss; the model config
refuses a non-SiLU activation too.

megatron-core 0.19.2 builds these flags from the TransformerConfig fields
(``megatron/training/argument_utils.py``: the field's type gives argparse's type, the field's docstring
the help). ``megatron.training`` needs Python >= 3.12 (``typing.override``);
on older Pythons the script gives ``typing`` the identical run-time decorator from
``typing_extensions`` first (it only sets ``__override__``), so the real argument code runs here too.
The GPU machine (Python 3.12) runs it without that shim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gdn_cp.modes.spec import MODE_CHOICES
from tests.conftest import start_smoke_run

REPO = Path(__file__).resolve().parents[2]


def readme_training_command() -> dict:
    """The ``[VAR=value ...] torchrun ... pretrain_hybrid.py`` block of the README: its script arguments
    (with ``$VARS`` replaced by placeholders), ``--nproc-per-node`` and the environment set before
    ``torchrun``."""
    import shlex

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.index("## Train a model with Megatron-LM")
    start = text.rindex("\n", 0, text.index("torchrun ", section)) + 1  # the line, with its environment
    block = text[start : text.index("```", start)].replace("\\\n", " ")
    words = shlex.split(block)
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    assert words[script] == "pretrain_hybrid.py", words[: script + 1]
    nproc = int(words[words.index("--nproc-per-node") + 1])
    env = dict(w.split("=", 1) for w in words[: words.index("torchrun")])
    return {"args": [w.replace("$", "PLACEHOLDER_") for w in words[script + 1 :]], "nproc": nproc, "env": env}

_SCRIPT = r"""
import argparse, contextlib, io, json, logging, os, sys, typing, warnings
warnings.filterwarnings("ignore")
if sys.version_info < (3, 12):
    import typing_extensions
    typing.override = typing_extensions.override
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
from gdn_cp_testing import lazy_compile; lazy_compile.install()  # megatron's import without TorchInductor's
from megatron.training.arguments import add_megatron_arguments
from megatron.training.argument_utils import core_transformer_config_from_args

parser = add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
from gdn_cp.modes.spec import MODE_CHOICES
(flag,) = [a for a in parser._actions if "--linear-cp-mode" in a.option_strings]
out = {"choices": flag.choices, "default": flag.default, "help": flag.help}
# `--help` itself fails on stock 0.19.2 (a '%' in --moe-paged-stash-buffer-size-factor-cuda's help
# breaks argparse's formatting): format this flag's entry the way --help would.
formatter = parser._get_formatter()
formatter.add_argument(flag)
out["help_entry"] = formatter.format_help()

model_without_swiglu = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --experimental-attention-variant "
                        "gated_delta_net --linear-attention-freq 4 --no-rope-fusion --normalization RMSNorm").split()
model = model_without_swiglu + ["--swiglu"]

def build(extra):
    args = parser.parse_args(model + extra)
    args.params_dtype = torch.float32  # set by validate_args in a real run
    try:
        return {"parsed": args.linear_cp_mode, "config": core_transformer_config_from_args(args).linear_cp_mode}
    except ValueError as e:
        return {"parsed": args.linear_cp_mode, "error": str(e)}

out["modes"] = {m: build(["--linear-cp-mode", m, "--context-parallel-size", "2"]) for m in MODE_CHOICES}
out["auto_odd_heads"] = build("--linear-cp-mode auto --context-parallel-size 4 --linear-num-key-heads 2 "
                              "--linear-num-value-heads 4".split())
out["auto_nothing_legal"] = build("--linear-cp-mode auto --tensor-model-parallel-size 2 --linear-num-key-heads 3 "
                                  "--linear-num-value-heads 6".split())
args = parser.parse_args(model_without_swiglu)  # the config alone (no validate_args): activation_func=gelu
args.params_dtype = torch.float32
try:
    core_transformer_config_from_args(args)
    out["config_without_swiglu"] = "accepted"
except ValueError as e:
    out["config_without_swiglu"] = str(e)
# validate_args, as Megatron-LM's initialize runs it (CPU stand-ins for its CUDA queries)
import megatron.training.arguments as margs
if not torch.cuda.is_available():
    margs.get_device_arch_version = lambda: 9
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
data = "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --lr 1e-4 --train-iters 1".split()
out["thd_split"] = {}
with contextlib.redirect_stdout(io.StringIO()):
    gdn_only = ["--linear-attention-freq", "8"]  # no standard-attention layer among the 4
    for name, extra in {"none": [], "inter_document_masking": ["--dataloader-inter-document-masking"] + gdn_only,
                        "inter_document_masking_attention": ["--dataloader-inter-document-masking",
                                                             "--calculate-per-token-loss"],
                        "inter_document_masking_attention_per_rank_average": ["--dataloader-inter-document-masking"],
                        "sft": ["--sft", "--calculate-per-token-loss"],
                        "both": ["--sft", "--dataloader-inter-document-masking", "--calculate-per-token-loss"],
                        "sft_per_rank_average": ["--sft"],
                        "contradiction": ["--sft", "--calculate-per-token-loss", "--linear-cp-thd-split", "whole_row"],
                        "gdn_only_padded": ["--dataloader-inter-document-masking", "--linear-cp-thd-split", "per_document",
                                            "--calculate-per-token-loss"] + gdn_only,
                        "no_swiglu": None,
                        }.items():
        words = model_without_swiglu if extra is None else model + extra
        args = parser.parse_args(words + data + ["--context-parallel-size", "2"])
        args.world_size, args.rank = 2, 0
        try:
            margs.validate_args(args, {})
            out["thd_split"][name] = [args.linear_cp_thd_split,
                                      core_transformer_config_from_args(args).linear_cp_thd_split]
        except ValueError as e:
            out["thd_split"][name] = str(e)
# the README's "Train a model" command line, as Megatron-LM's parser and validate_args see it
readme = json.loads(os.environ["GDN_CP_README_COMMAND"])
with contextlib.redirect_stdout(io.StringIO()):
    args = parser.parse_args(readme["args"])
    args.world_size, args.rank = readme["nproc"], 0
    margs.validate_args(args, {})
    config = core_transformer_config_from_args(args)
out["readme"] = {"thd_split": args.linear_cp_thd_split, "mode": config.linear_cp_mode,
                 "cp": config.context_parallel_size, "pattern": args.hybrid_layer_pattern, "num_layers": args.num_layers,
                 "activation": config.activation_func.__name__, "normalization": config.normalization}
(split_flag,) = [a for a in parser._actions if "--linear-cp-thd-split" in a.option_strings]
out["thd_split_choices"] = [split_flag.choices, split_flag.default]
(backend_flag,) = [a for a in parser._actions if "--linear-cp-backend" in a.option_strings]
out["backend_choices"] = [backend_flag.choices, backend_flag.default]
args = parser.parse_args(model + ["--linear-cp-backend", "reference"])
args.params_dtype = torch.float32
out["backend_config"] = core_transformer_config_from_args(args).linear_cp_backend
out["typo"] = {}
for flag_name, value in (("--linear-cp-mode", "head_wise"), ("--linear-cp-backend", "triton")):
    args = parser.parse_args(model + data + [flag_name, value, "--context-parallel-size", "2"])  # argparse takes it
    args.world_size, args.rank = 2, 0
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            margs.validate_args(args, {})
        out["typo"][flag_name] = "accepted"
    except ValueError as e:
        out["typo"][flag_name] = str(e)
with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
    json.dump(out, f)
"""

# the script's process (imports megatron.training: seconds) starts in the background when the session starts
# (tests/conftest.py), unless the session may patch the installed megatron-core while it runs
SMOKE_RUNS = {"parsed": ("-c", [_SCRIPT], {"GDN_CP_README_COMMAND": json.dumps(readme_training_command())})}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def parsed(patched_megatron):
    """``(the script's answers, everything it printed)``."""
    if sys.version_info < (3, 12):
        typing_extensions = pytest.importorskip("typing_extensions", reason="megatron.training needs typing.override")
        if not hasattr(typing_extensions, "override"):
            pytest.skip("Python < 3.12 and typing_extensions without override: megatron.training cannot import")
    code, printed, out = start_smoke_run(sys.modules[__name__], "parsed").result(timeout_s=600)
    assert code == 0 and out.exists(), printed[-6000:]
    return json.loads(out.read_text()), printed


@pytest.mark.megatron
def test_linear_cp_mode_flag_of_megatron_training(parsed):
    out, printed = parsed

    from gdn_cp.ops.registry import BACKEND_CHOICES

    # the patched fields name no mode and no backend: argparse takes any string, gdn-cp's registries check it
    assert out["backend_choices"] == [None, "auto"] and out["backend_config"] == "reference", out
    assert out["choices"] is None and out["default"] == "auto"
    assert "--linear-cp-mode LINEAR_CP_MODE" in out["help_entry"], out["help_entry"]
    assert "gdn-cp's modes" in out["help"] and '"auto"' in out["help"], out["help"]  # the field's docstring
    choices = ", ".join(repr(c) for c in MODE_CHOICES)
    assert out["typo"]["--linear-cp-mode"].startswith(f"linear_cp_mode='head_wise' is not a known mode; set it to one "
                                                      f"of {choices}"), out["typo"]
    backends = ", ".join(repr(c) for c in BACKEND_CHOICES)
    assert out["typo"]["--linear-cp-backend"].startswith(f"TransformerConfig.linear_cp_backend='triton' is not a "
                                                         f"backend; set it to one of {backends}"), out["typo"]

    # explicit modes pass through; auto arrives at the config as the mode it resolves to, the same
    # on every machine: chunkwise wherever it is legal
    for mode in ("headwise", "chunkwise", "all_gather"):
        assert out["modes"][mode] == {"parsed": mode, "config": mode}, out["modes"]
    assert out["modes"]["auto"] == {"parsed": "auto", "config": "chunkwise"}
    assert "gdn-cp linear_cp_mode: requested=auto" in printed  # logged with the reason
    assert out["auto_odd_heads"]["config"] == "chunkwise", out["auto_odd_heads"]
    error = out["auto_nothing_legal"]["error"]
    assert "linear_cp_mode='auto': no mode is legal" in error and "linear_num_key_heads=3" in error and "Fix:" in error

    # --linear-cp-thd-split: set from the data flags by validate_args, into the model config
    assert out["thd_split_choices"] == [None, None]
    split = out["thd_split"]
    assert split["none"] == [None, None]  # no packed rows: nothing to say
    assert split["inter_document_masking"] == ["whole_row", "whole_row"]  # a GDN-only model: the whole-row cut
    assert split["sft"] == ["per_document", "per_document"] and split["both"] == ["per_document", "per_document"]
    assert "--linear-cp-thd-split whole_row contradicts --sft" in split["contradiction"], split["contradiction"]
    # a GDN-only model keeps the whole-row cut unless the padded per-document cut is asked for
    assert split["gdn_only_padded"] == ["per_document", "per_document"]
    # SFT loss masks differ between CP ranks: refused without --calculate-per-token-loss (Megatron-LM would
    # average each rank's loss over its own tokens)
    assert split["sft_per_rank_average"].startswith("--sft at --context-parallel-size 2 without "
                                                    "--calculate-per-token-loss: "), split["sft_per_rank_average"]
    # attention layers at CP > 1 expect every document cut in 2*cp parts: the rows are padded and cut per
    # document, which needs per-token loss (the pads fall unevenly on the ranks)
    assert split["inter_document_masking_attention"] == ["per_document", "per_document"]
    msg = split["inter_document_masking_attention_per_rank_average"]
    assert msg.startswith("--dataloader-inter-document-masking at --context-parallel-size 2 pads every document to a "
                          "multiple of 2*cp and cuts it in 2*cp parts (the model's --experimental-attention-variant "
                          "gated_delta_net with --linear-attention-freq 4: standard attention at layer 4), without "
                          "--calculate-per-token-loss: "), msg
    # GDN computes SiLU: without --swiglu, validate_args and the model config both refuse
    assert split["no_swiglu"].startswith("--experimental-attention-variant gated_delta_net builds gated delta net "
                                         "layers, which compute SiLU"), split["no_swiglu"]
    assert "activation_func=gelu; add --swiglu" in split["no_swiglu"], split["no_swiglu"]
    assert out["config_without_swiglu"].startswith("TransformerConfig.activation_func=gelu, but gated delta net "
                                                   "layers need SiLU"), out["config_without_swiglu"]

    # the README's training command parses, validates and gives the config the README says
    assert out["readme"] == {"thd_split": None, "mode": "chunkwise", "cp": 2, "pattern": "G-G-*-",
                             "num_layers": 6, "activation": "silu", "normalization": "RMSNorm"}, out["readme"]
