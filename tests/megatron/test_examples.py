"""examples/ (issue #49: a Megatron user had nothing to copy; the docs recipe imported the test toolkit):

* ``examples/train_gdn_cp.py``, a training loop on megatron-core's and gdn-cp's public API alone, trains the
  same model at CP=1 and at CP=2 (torchrun, gloo ranks on the CPU): every step's loss equal, and falling;
* ``examples/megatron_lm/train_qwen3_next.sh``, the Megatron-LM command of a Qwen3-Next-shaped hybrid with
  gdn-cp's flags: its arguments (``PRINT_ARGS=1``) pass Megatron-LM's own parser, ``validate_args`` (patched)
  and ``core_transformer_config_from_args``, at its default size, on 8 GPUs, packed or not, and at the full
  Qwen3-Next-80B-A3B shape its header gives. ``megatron.training`` needs Python >= 3.12 (``typing.override``):
  on 3.11 the parse gives ``typing`` the identical run-time decorator of ``typing_extensions`` first (as
  ``test_training_args.py`` does), and skips, saying why, where neither imports.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import start_smoke_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LOOP = EXAMPLES / "train_gdn_cp.py"
QWEN = EXAMPLES / "megatron_lm" / "train_qwen3_next.sh"


def test_the_training_loop_uses_public_api_only():
    """No test toolkit (the wheel does not ship it), no private name of gdn-cp, only torch, megatron.core,
    gdn_cp and the standard library."""
    tree = ast.parse(LOOP.read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    for module in (m for m in modules if m != "__future__"):
        top = module.split(".")[0]
        assert top in sys.stdlib_module_names or top in ("torch", "megatron", "gdn_cp"), module
        assert top != "megatron" or module.startswith("megatron.core"), module
        assert not any(part.startswith("_") for part in module.split(".")), module
    assert "gdn_cp_testing" not in LOOP.read_text()


# the CP=1 and CP=2 runs start in the background when the session starts (tests/conftest.py queues the runs
# a selected test names as a fixture), unless the session may patch the installed megatron-core while it runs
# TORCHDYNAMO_DISABLE: megatron's jit_fuser functions (its GDN's _apply_gated_norm, torch.compile) run as plain
# Python, as in the CPU rank pools: compiling them for a CPU builds C++ for ~20 CPU s in each of the three
# processes (the pair: 49 CPU s and 33 s with it, 13 CPU s and 7 s without); the losses are the same either way.
# The docs recipe's pair (tests/megatron/test_docs_recipe.py) still runs with torch.compile on, as a user's would.
SMOKE_RUNS = {"loop_runs": ("gdn_cp_testing.cp_pair", ["--script", str(LOOP), "--timeout", "600"],
                            {"TORCHDYNAMO_DISABLE": "1"}),
              # the Megatron-LM command's cases through Megatron-LM's parser, in one process (imports megatron.training)
              "parsed": lambda: ("-c", [_PARSE, json.dumps(_parse_cases())])}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def loop_runs(patched_megatron):
    return start_smoke_run(sys.modules[__name__], "loop_runs").result(timeout_s=900)


@pytest.mark.megatron
@pytest.mark.slow
def test_the_training_loop_trains_the_same_model_at_cp2_as_at_cp1(loop_runs):
    code, printed, out = loop_runs
    assert code == 0, printed[-3000:]
    runs = json.loads(out.read_text())
    losses, stderr = {}, {}
    for cp in (1, 2):
        run = runs[str(cp)]
        stderr[cp] = run["stderr"]
        assert run["returncode"] == 0, (cp, run["stdout"][-2000:], stderr[cp][-4000:])
        losses[cp] = [float(x) for x in re.findall(rf"^CP={cp} step \d+: loss ([0-9.]+)$", run["stdout"], re.M)]
    assert len(losses[1]) == len(losses[2]) == 10, losses
    assert losses[1][-1] < 0.5 * losses[1][0], losses[1]  # it learns
    for step, (one, two) in enumerate(zip(losses[1], losses[2]), 1):
        assert abs(one - two) <= 1e-4 * one, (step, one, two)  # float32; a CP fault moves it by far more
    assert "requested=auto resolved=chunkwise" in stderr[2]
    assert "GatedDeltaNet layer 1 runs linear_cp_mode=chunkwise (TP=1, CP=2" in stderr[2]
    said = f"falling from {losses[1][0]:.1f} to {losses[1][-1]:.1f} in {len(losses[1])} steps"
    assert said in " ".join((REPO / "README.md").read_text().split()), said  # the README's figures are this run's


def test_the_readme_points_at_the_examples_and_says_what_docker_has_shown():
    text = " ".join((REPO / "README.md").read_text().split())
    section = text[text.index("## Examples to copy"):text.index("## Train a model with Megatron-LM")]
    for path in (LOOP, QWEN):
        assert f"`{path.relative_to(REPO)}`" in section, path
    assert "`docker/`" in section and "never been built" in section
    assert "has not been built" in (REPO / "docker" / "README.md").read_text()  # what docker/README.md says too
    two = text[text.index("## The two commands"):text.index("```bash", text.index("## The two commands"))]
    assert "**Python 3.12**" in two and "Python 3.11 both commands below run" in two, two  # said before them


# ------------------------------------------------------------------------------------------------------
# the Megatron-LM command
# ------------------------------------------------------------------------------------------------------
def full_shape() -> dict[str, str]:
    """The full Qwen3-Next-80B-A3B shape, as the script's header gives it (one line of VAR=value)."""
    (line,) = re.findall(r"^#   (PATTERN_REPEAT=.*)$", QWEN.read_text(), re.M)
    return dict(word.split("=", 1) for word in shlex.split(line))


def script_args(**env) -> list[str]:
    r = subprocess.run(["bash", str(QWEN)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "PRINT_ARGS": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout.splitlines()


_PARSE = r"""
import argparse, contextlib, importlib.util, io, json, os, sys, typing, warnings
warnings.filterwarnings("ignore")
if sys.version_info < (3, 12):
    import typing_extensions
    typing.override = typing_extensions.override
import torch
from gdn_cp_testing import lazy_compile; lazy_compile.install()  # megatron's import without TorchInductor's
import megatron.training.arguments as margs
from megatron.training.argument_utils import core_transformer_config_from_args

if not torch.cuda.is_available():  # this machine's stand-ins for an H200's answers
    margs.get_device_arch_version = lambda: 9
    torch.cuda.get_device_capability = lambda *a: (9, 0)
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # the script sets it
parser = margs.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_hybrid.py"))
out = {}
for name, (words, world) in json.loads(sys.argv[1]).items():
    args = parser.parse_args(words)
    args.world_size, args.rank = world, 0
    if importlib.util.find_spec("transformer_engine") is None:
        args.apply_rope_fusion = False  # TransformerEngine's (the GPU machine has it)
    with contextlib.redirect_stdout(io.StringIO()):
        margs.validate_args(args, {})
    config = core_transformer_config_from_args(args)
    out[name] = {"mode": config.linear_cp_mode, "backend": config.linear_cp_backend, "thd_split": args.linear_cp_thd_split,
                 "cp": config.context_parallel_size, "dp": args.data_parallel_size, "layers": args.num_layers,
                 "pattern": args.hybrid_layer_pattern, "experts": config.num_moe_experts, "hidden": config.hidden_size,
                 "gate": config.attention_output_gate, "zero_centered": config.layernorm_zero_centered_gamma,
                 "per_token_loss": config.calculate_per_token_loss, "aux_loss": config.moe_aux_loss_coeff,
                 "seq": args.seq_length}
with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
    json.dump(out, f)
"""


def _parse_cases() -> dict:
    """``{case: (the script's arguments, world size)}``."""
    return {
        "default": (script_args(), 2),
        "eight_gpus": (script_args(GPUS="8", CP="4"), 8),
        "sbhd": (script_args(PACKED="0"), 2),
        "headwise": (script_args(LINEAR_CP_MODE="headwise", LINEAR_CP_BACKEND="reference"), 2),  # fla: refused where no GPU
        "full": (script_args(**full_shape(), GPUS="8", CP="2"), 8),
    }


@pytest.fixture(scope="module")
def parsed(patched_megatron):
    if sys.version_info < (3, 12):
        pytest.importorskip("typing_extensions", reason="megatron.training needs typing.override (Python >= 3.12)")
    code, printed, out = start_smoke_run(sys.modules[__name__], "parsed").result(timeout_s=600)
    assert code == 0 and out.exists(), printed[-4000:]
    return json.loads(out.read_text())


@pytest.mark.megatron
def test_the_megatron_lm_command_passes_megatron_lms_own_parser(parsed):
    got = parsed
    default = got["default"]
    assert default["mode"] == "chunkwise" and default["backend"] == "auto" and default["cp"] == 2, default
    assert default["thd_split"] == "per_document" and default["per_token_loss"] and default["aux_loss"] in (0, [0]), default
    assert default["pattern"] == "GEGEGE*E" * 2 and default["layers"] == 16 and default["gate"] and default["zero_centered"]
    assert got["eight_gpus"]["cp"] == 4 and got["eight_gpus"]["dp"] == 2, got["eight_gpus"]
    assert got["sbhd"]["thd_split"] is None and got["sbhd"]["aux_loss"] in (1e-3, [1e-3]), got["sbhd"]
    assert got["headwise"]["mode"] == "headwise" and got["headwise"]["backend"] == "reference", got["headwise"]
    full = got["full"]
    assert (full["layers"], full["hidden"], full["experts"], full["seq"]) == (96, 2048, 512, 262144), full
    assert full["pattern"] == "GEGEGE*E" * 12 and full["mode"] == "chunkwise", full


def test_the_megatron_lm_command_refuses_a_gpu_count_cp_does_not_divide():
    r = subprocess.run(["bash", str(QWEN)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GPUS": "3", "CP": "2", "PRINT_ARGS": "1"})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "GPUS=3" in r.stderr, r


def test_the_megatron_lm_command_checks_the_patch_before_it_launches(tmp_path):
    """Run for real without a GPU machine: it stops at `gdn-cp patch check` (a folder that is no Megatron-LM
    checkout: exit 2, one line) before torchrun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\necho torchrun ran >&2\nexit 99\n")
    (bin_dir / "torchrun").chmod(0o755)
    r = subprocess.run(["bash", str(QWEN)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MEGATRON_LM": str(tmp_path),
                            "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])})
    assert r.returncode == 2 and "torchrun ran" not in r.stderr and "gdn-cp patch check: error:" in r.stderr, r
