"""The README's and docs' checkable claims, checked, each in the file that makes it: the patch size
(docs/megatron.md), the error messages and the exit-status rule (docs/errors.md), the install advice and
the training command (README), the commands and paths every page names (issue #19: "every README
claim true"; issue #24: the tests follow the files)."""

from __future__ import annotations

import re
import shlex
import types
from pathlib import Path

import pytest

import gdn_cp
from gdn_cp.cli import build_parser
from gdn_cp.cli.output import EXIT_STATUS
from gdn_cp.patch import PINNED_VERSION, load_manifest, patch_dir

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {name: (ROOT / name).read_text() for name in
        ("README.md", "docs/megatron.md", "docs/errors.md", "docs/architecture.md", "docs/testing.md",
         "docs/performance.md", "docs/flashqla.md")}
MEGATRON_DOC, ERRORS_DOC, PERFORMANCE_DOC = DOCS["docs/megatron.md"], DOCS["docs/errors.md"], DOCS["docs/performance.md"]
ALL_DOCS = "\n".join(DOCS.values())


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------
# "The patch is thin (N added and M removed lines in F files)"
# ------------------------------------------------------------------------------------------
def _patch_size() -> tuple[int, int, int]:
    """Lines added / removed by the pinned patch's hunks, and the files it changes, from patches/."""
    added = removed = 0
    files = load_manifest().files
    for target in files:
        text = (patch_dir() / target.patch).read_text()
        body = text[text.index("\n--- a/"):]  # after the header comment
        for line in body.splitlines():
            if line.startswith("+") and not line.startswith("+++ "):
                added += 1
            elif line.startswith("-") and not line.startswith("--- "):
                removed += 1
    return added, removed, len(files)


def test_patch_size_in_the_readme_is_the_patch_files():
    found = re.search(r"The patch is thin \((\d+) added and (\d+) removed lines in (\d+) files\)", _one_line(MEGATRON_DOC))
    assert found, "docs/megatron.md: 'The patch is thin (N added and M removed lines in F files)' is gone"
    assert tuple(map(int, found.groups())) == _patch_size(), (
        f"README says {found.group(0)}; the patch files of {PINNED_VERSION} add / remove / touch {_patch_size()}")


# ------------------------------------------------------------------------------------------
# "message starts with": each row is the start of a message the code produces
# ------------------------------------------------------------------------------------------
def _message_rows() -> list[str]:
    table = ERRORS_DOC[ERRORS_DOC.index("| message starts with | what to do |"):]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(re.match(r"\| `(.*?)`", line).group(1))
    return rows


def _error(call) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as err:
        return str(err)
    raise AssertionError("no error")


def _fake_tree(tmp_path: Path) -> Path:
    """A folder with megatron/core whose target files are not 0.19.2's (another release)."""
    for t in load_manifest().files:
        path = tmp_path.joinpath(*t.target.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# not megatron-core 0.19.2\n")
    return tmp_path


def _producers(tmp_path: Path, monkeypatch) -> dict:
    """Row -> a call that produces a message starting with it, through a public path (the patched
    forward's rows through the forward itself, on a stand-in layer)."""
    import torch

    from gdn_cp.cli.main_job import JobConfig, check_job
    from gdn_cp.layout import validate_cu_seqlens
    from gdn_cp.layout.plan import RouteCache, plan_for_sbhd
    from gdn_cp import patch
    from gdn_cp.megatron import call, gdn
    from gdn_cp.megatron.config import configure_linear_cp_mode, resolve_linear_cp_mode
    from gdn_cp.megatron.rules import check_linear_cp_mode
    from gdn_cp.megatron.thd_split import configure_megatron_lm_args, record_split
    from gdn_cp.modes import GDNShape, Settings, gdn_core
    from gdn_cp.modes.swap import choose_swap_point
    from gdn_cp.ops import get_backend
    from gdn_cp.ops.gates import check_log_decay
    from gdn_cp_testing.stand_ins import StandInGroup, stand_in_gdn

    reference = get_backend("reference")

    shape = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    config = types.SimpleNamespace(linear_cp_mode="headwise", linear_num_key_heads=4, linear_num_value_heads=6,
                                   tensor_model_parallel_size=1, context_parallel_size=1,
                                   experimental_attention_variant="gated_delta_net")
    tp_group, cp_group = StandInGroup(2), StandInGroup(4)
    monkeypatch.setattr(call, "group_ranks", lambda group: (0, 1) if group is tp_group else (0, 1, 2, 3))

    from gdn_cp.megatron.document_padding import pad_and_cut

    def flat_batch():
        """A flattened packed batch of documents of 3 and 5 tokens (as Megatron-LM's get_batch flattens it)."""
        rows = {k: torch.zeros(1, 8, dtype=torch.int64) for k in ("tokens", "labels", "position_ids")}
        return dict(rows, loss_mask=torch.ones(1, 8), cu_seqlens=torch.tensor([[0, 3, 8]], dtype=torch.int32),
                    max_seqlen=torch.tensor([5]), attention_mask=None, cu_seqlens_padded=None)

    def forward(layer, packed_seq_params=None, rows=4):
        gdn.gated_delta_net_forward(layer, torch.zeros(rows, 1, 8), packed_seq_params=packed_seq_params)

    def packed(cu, **dynamic):
        return types.SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(cu, dtype=torch.int32),
                                     cu_seqlens_q=None, **dynamic)

    def split_layer(setting):
        return stand_in_gdn(cp_group=StandInGroup(2), linear_cp_thd_split=setting)

    def recorded_contradiction():
        params = packed([0, 4, 8])
        record_split({"cu_seqlens_padded": params.cu_seqlens_q_padded}, "whole_row")
        forward(split_layer("per_document"), params)

    def not_importable():
        monkeypatch.setattr(patch.tree.importlib.util, "find_spec", lambda name: None)
        patch.find_megatron_root()

    def too_large_for_memory():
        from gdn_cp.cli import main_job

        monkeypatch.delenv("GDN_CP_CHUNKWISE_PATH", raising=False)  # bad_env's setting is not this row's
        monkeypatch.setattr(main_job, "_available_memory", lambda: 23 << 30)
        check_job(JobConfig(tokens_per_rank=1 << 20))

    def bad_env():
        with monkeypatch.context() as local:
            local.setenv("GDN_CP_CHUNKWISE_PATH", "ring")
            Settings.from_environment(mode="chunkwise")

    return {
        "sequence ... of cu_seqlens has length ..., not divisible by 2*cp=...":
            lambda: validate_cu_seqlens([0, 6, 8], 2),
        "SBHD sequence length seq_len=... is not divisible by 2*cp=...": lambda: plan_for_sbhd(6, 1, 2, 0),
        "cu_seqlens[...]=... is out of range": lambda: validate_cu_seqlens([0, 2**63], 1),
        "linear_cp_mode='headwise' with tensor_model_parallel_size=..., context_parallel_size=...: ... is not "
        "divisible by TP*CP=...": lambda: resolve_linear_cp_mode("headwise", num_key_heads=4, num_value_heads=8,
                                                                 tp=1, cp=8),
        "linear_num_value_heads=... must be a multiple of linear_num_key_heads=...":
            lambda: configure_linear_cp_mode(config),
        "linear_cp_mode='auto': no mode is legal":
            lambda: resolve_linear_cp_mode("auto", num_key_heads=3, num_value_heads=6, tp=2, cp=1),
        "GatedDeltaNet (layer ...), CP group of this call has ... ranks: linear_cp_mode='auto' must be resolved":
            lambda: forward(stand_in_gdn(cp_group=StandInGroup(2), linear_cp_mode="auto", heads=(16, 32),
                                         layer_number=3)),
        "g (log decay) must be finite and <= 0": lambda: check_log_decay(torch.tensor([[0.5]])),
        "PackedSeqParams.cp_group and local_cp_size must be set together":
            lambda: forward(stand_in_gdn(), packed([0, 8], cp_group=StandInGroup(2), local_cp_size=None)),
        "the plan was built for cp=... but the process group has ...":
            lambda: gdn_core(None, None, None, None, None, shape=shape, mode="chunkwise",
                             plan=RouteCache().plan([0, 8], 2, 0), group=None, backend=reference),
        "PackedSeqParams.cp_group has ranks ..., of which ... are also in this layer's tensor-parallel group":
            lambda: forward(stand_in_gdn(tp_size=2, tp_group=tp_group),
                            packed([0, 16], cp_group=cp_group, local_cp_size=4)),
        "chunkwise swap at hidden_states (GDN_CP_CHUNKWISE_SWAP=hidden) is not possible with sequence_parallel=True":
            lambda: choose_swap_point(shape=shape, hidden_size=64, tp=2, sequence_parallel=True, act_bytes=2,
                                      requested="hidden"),
        "cannot apply the patch in ...: ... is modified": lambda: patch.apply_patch(_fake_tree(tmp_path)),
        "megatron-core is not importable from this Python (install it: ...)": not_importable,
        "environment variable GDN_CP_...": bad_env,
        "PackedSeqParams.cu_seqlens_q_padded (per_document split: ...): sequence ... has length ..., not "
        "divisible by 2*cp=...": lambda: forward(split_layer("per_document"), packed([0, 3, 8])),
        "TransformerConfig.linear_cp_thd_split=..., but Megatron's get_batch_on_this_cp_rank cut these rows ...":
            recorded_contradiction,
        "--linear-cp-thd-split ... contradicts ...": lambda: configure_megatron_lm_args(types.SimpleNamespace(
            sft=False, dataloader_inter_document_masking=True, hybrid_context_parallel=False,
            linear_cp_thd_split="per_document")),
        "TransformerConfig.linear_cp_thd_split is None and these packed (THD) rows carry no record of Megatron's "
        "get_batch_on_this_cp_rank": lambda: forward(split_layer(None), packed([0, 4, 8])),
        "TransformerConfig.activation_func=..., but gated delta net layers need SiLU":
            lambda: configure_linear_cp_mode(types.SimpleNamespace(**dict(vars(config), linear_num_value_heads=8,
                                                                        activation_func=torch.nn.functional.gelu))),
        "GatedDeltaNet (layer ...): config.activation_func=..., but gated delta net layers need SiLU":
            lambda: forward(stand_in_gdn(act_fn=torch.nn.functional.gelu, layer_number=2)),
        "--... gated delta net layers ..., which compute SiLU (their conv and output gate), but without --swiglu ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(hybrid_layer_pattern="G-G-*-", swiglu=False)),
        "--dataloader-inter-document-masking at --context-parallel-size ... pads every document to a multiple of "
        "2*cp and cuts it in 2*cp parts (...), without --calculate-per-token-loss: ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="G-G-*-", swiglu=True, dataloader_inter_document_masking=True,
                context_parallel_size=2)),
        "--dataloader-inter-document-masking at --context-parallel-size ... pads every document to a multiple of "
        "2*cp and cuts it in 2*cp parts (...), which cannot run with ...: ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="G-G-*-", swiglu=True, dataloader_inter_document_masking=True,
                context_parallel_size=2, calculate_per_token_loss=True, pipeline_model_parallel_size=3)),
        "--linear-cp-thd-split whole_row with --dataloader-inter-document-masking at --context-parallel-size ...: "
        "this model has layers that expect every document cut into 2*cp parts ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="G-G-*-", swiglu=True, dataloader_inter_document_masking=True,
                context_parallel_size=2, linear_cp_thd_split="whole_row")),
        "--pipeline-model-parallel-size ... with --dataloader-inter-document-masking and --micro-batch-size ... with "
        "--moe-token-dispatcher-type allgather: ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="GE*-", swiglu=True, dataloader_inter_document_masking=True,
                calculate_per_token_loss=True, pipeline_model_parallel_size=2, micro_batch_size=2, num_experts=4,
                moe_token_dispatcher_type="allgather")),
        "--dataloader-inter-document-masking with --hybrid-context-parallel at --context-parallel-size ...: ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="G-G-*-", swiglu=True, dataloader_inter_document_masking=True,
                hybrid_context_parallel=True, calculate_per_token_loss=True, context_parallel_size=2)),
        "pad_and_cut got a batch whose cu_seqlens_padded differs from its cu_seqlens: its rows are padded already":
            lambda: pad_and_cut(dict(flat_batch(), cu_seqlens_padded=torch.tensor([[0, 4, 8]])), 2, 0),
        "pad_and_cut got a batch with an attention_mask":
            lambda: pad_and_cut(dict(flat_batch(), attention_mask=torch.ones(1, 1, 8, 8)), 2, 0),
        "--sft at --context-parallel-size ... without --calculate-per-token-loss: ...":
            lambda: configure_megatron_lm_args(types.SimpleNamespace(
                hybrid_layer_pattern="G-G-*-", swiglu=True, sft=True, context_parallel_size=2)),
        "--modes ... cannot run at --cp ... with --heads ...": lambda: check_job(JobConfig(modes=("headwise",),
                                                                                           cp_sizes=(8,))),
        "--tokens-per-rank ... at --cp ...: the ... ranks would need about ... GiB of memory": too_large_for_memory,
        # the first column of check_linear_cp_mode's table row (kept to show the config and the forward agree)
        "_check": lambda: check_linear_cp_mode("headwise", num_key_heads=4, num_value_heads=8, tp=1, cp=8),
    }


def test_every_message_row_is_a_message_the_code_produces(tmp_path, monkeypatch):
    """Each row of the README's "message starts with" table (``...`` stands for any text) is the start
    of the message of a real call; a row without a producer here, or a producer without a row, fails."""
    producers = _producers(tmp_path, monkeypatch)
    producers.pop("_check")
    rows = _message_rows()
    assert sorted(rows) == sorted(producers), (set(rows) ^ set(producers))
    for row in rows:
        message = _error(producers[row])
        pattern = ".+?".join(re.escape(part) for part in row.split("..."))
        assert re.match(pattern, message), f"README row {row!r} does not start the real message {message!r}"


# ------------------------------------------------------------------------------------------
# the exit-status rule: written once (gdn_cp.cli.output), quoted by the README and by --help
# ------------------------------------------------------------------------------------------
def test_exit_status_rule_is_the_one_the_commands_print(capsys):
    assert _one_line(EXIT_STATUS) in _one_line(ERRORS_DOC)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert _one_line(EXIT_STATUS) in _one_line(capsys.readouterr().out)
    assert "Exit status of the commands:" not in ALL_DOCS  # the per-command list this replaced


# ------------------------------------------------------------------------------------------
# install advice: one text, the README's commands, and the patched files' copy of it
# ------------------------------------------------------------------------------------------
def test_readme_installs_from_the_repository_not_a_package_index():
    assert not re.search(r"pip install\s+(?:-\S+\s+)*['\"]?gdn-cp\b", README), "gdn-cp is not on a package index yet"
    assert "pip install -e '.[megatron,fla]'" in README and "not on a package index yet" in README
    assert "pip install -e <clone>" in gdn_cp.INSTALL_HINT


def test_patched_files_give_the_one_install_advice():
    for target in load_manifest().files:
        text = (patch_dir() / target.patch).read_text()
        if "ImportError" in text:
            assert "`pip install gdn-cp`" not in text, target.patch
            joined = re.sub(r'"\s*\n\+\s*f?"', "", text)  # adjacent string literals of the hunk, joined
            assert _one_line(gdn_cp.INSTALL_HINT).lower() in _one_line(joined).lower(), target.patch


# ------------------------------------------------------------------------------------------
# every gdn-cp command line and every path the README names
# ------------------------------------------------------------------------------------------
def _readme_commands() -> list[list[str]]:
    """``gdn-cp ...`` invocations in the code blocks and inline code of the README and the docs."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", ALL_DOCS, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0]
            for part in re.split(r"&&|\|", line):
                words = shlex.split(part)
                if words[:1] == ["gdn-cp"]:
                    found.append(words[1:])
    for inline in re.findall(r"`(gdn-cp [^`]*)`", ALL_DOCS):
        words = shlex.split(inline.replace("[--rank r]", ""))
        if "..." not in inline and "COMMAND" not in inline and "|" not in inline:
            found.append(words[1:])
    return found


def test_every_gdn_cp_command_in_the_readme_parses(capsys, tmp_path, monkeypatch):
    commands = _readme_commands()
    assert len(commands) > 10 and ["run"] in commands
    parser = build_parser()
    monkeypatch.chdir(tmp_path)  # the paths the commands name exist where a user runs them (a PATH must exist)
    for argv in commands:
        if argv[:1] == ["patch"] and "/nope" not in argv:
            for word in argv[2:]:
                if not word.startswith("-") and word not in ("patched", "pristine"):
                    (tmp_path / word).mkdir(exist_ok=True)
    for argv in commands:
        if "/nope" in argv:  # the exit-status examples: said to exit 2, checked below
            continue
        if "--help" in argv:
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args(argv)
            assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: gdn-cp {argv[0]}"), argv
            continue
        args = parser.parse_args(argv)
        assert args.command == argv[0], argv


def test_every_path_the_readme_names_exists():
    """Code, tests, scripts and docs the README and the docs point to (benchmark result files are written
    by the runs they describe, some of which they say have not run yet: not checked here). A removed benchmark
    is named with the commit that has it (`` `benchmarks/x.py` at commit 0123abc``), and not looked for."""
    named = set(re.findall(r"(?<![\w./-])((?:gdn_cp|tests|docker|patches|docs)/[\w./{},-]*[\w}])", ALL_DOCS))
    named |= set(re.findall(r"(?<![\w./-])(benchmarks/[\w./-]*\.(?:py|sh))(?!`?\s+at\s+commit\s+[0-9a-f]{7})", ALL_DOCS))
    paths = set()
    for path in named:  # a/b_{x,y}.py names a/b_x.py and a/b_y.py
        brace = re.search(r"\{([^}]*)\}", path)
        paths |= {path[:brace.start()] + alt + path[brace.end():] for alt in brace.group(1).split(",")} if brace \
            else {path}
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (ROOT / (p + ".py")).exists())
    assert missing == [], missing


def test_exit_status_examples_exit_as_the_readme_says(capsys):
    from gdn_cp.cli import main

    text = _one_line(ERRORS_DOC)
    assert "`gdn-cp patch apply /nope` and `gdn-cp doctor --path /nope` both exit 2" in text
    for argv in (["patch", "apply", "/nope"], ["doctor", "--path", "/nope"]):
        try:
            rc = main(argv)
        except SystemExit as exit_:  # argparse's own refusal of a path that does not exist
            rc = exit_.code
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == "" and "/nope does not exist" in cap.err, (argv, rc, cap)


def test_a_bad_flag_prints_the_one_line_the_readme_shows(capsys):
    """Issue #25: argparse printed its usage block (2-6 lines) before the error the README promised
    as one line; the usage is now behind --help (tests/cli/test_cli.py covers every command)."""
    from gdn_cp.cli import main

    row = "`gdn-cp COMMAND: error: argument --flag: ...; usage: gdn-cp COMMAND --help`"
    assert row in _one_line(ERRORS_DOC)
    for argv in (["run", "--cp", "1_0"], ["route", "--cu", "0,,8", "--cp", "2"], ["doctor", "--heads", "128 256"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        cap = capsys.readouterr()
        expected = row.strip("`").replace("COMMAND", argv[0]).replace("--flag", argv[1])
        pattern = ".+?".join(re.escape(part) for part in expected.split("...")) + "\n"
        assert cap.out == "" and re.fullmatch(pattern, cap.err), (pattern, cap.err)


def test_the_readme_names_no_path_outside_the_repository():
    """Issue #25: `bash ../shared/tools/slim-triton/make.sh .slim` pointed at a folder a user does not
    have; what the README tells a user to run lives in this repository (or is a package to install)."""
    outside = re.findall(r"`[^`]*\.\./[^`]*`", ALL_DOCS)
    assert outside == [], outside


@pytest.mark.parametrize("where,expected", [("base", 2), ("venv", 97)])
def test_install_deps_refuses_outside_a_virtual_environment(tmp_path, where, expected):
    """Issue #25: tests/install_deps.sh patches the megatron-core of whatever environment is active;
    the README says "in a fresh virtual environment" and the script refuses elsewhere (exit 2, one
    line) before installing anything. A stand-in Python answers the script's `-c` checks as the base
    interpreter or this venv would, and fails (97) at the first install, so nothing is installed here."""
    import os
    import subprocess
    import sys

    assert "in a fresh virtual environment" in _one_line(README)
    real = getattr(sys, "_base_executable", sys.executable) if where == "base" else sys.executable
    if where == "base" and real == sys.executable:
        pytest.skip("this Python is not in a virtual environment")
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec "{real}" "$@"; fi\nexit 97\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "tests" / "install_deps.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": str(fake)})
    assert r.returncode == expected, (r.returncode, r.stderr)
    if where == "base":
        assert r.stderr.count("\n") == 1 and "is not a virtual environment" in r.stderr and "--any-env" in r.stderr
    else:  # issue #32: a minute of silence; one progress line per step, the first before its install
        assert re.fullmatch(r"tests/install_deps.sh: \[1/4\] torch 2\.13\.0 from the configured index .+ gdn-cp .+ "
                            r"\(\d+ s so far\)\n", r.stdout), r.stdout


@pytest.mark.parametrize("flag,index", [("--cpu-torch", "reachable"), ("--cpu-torch", "unreachable"), (None, None)])
def test_install_deps_takes_torchs_cpu_build_where_asked(tmp_path, flag, index):
    """Issue #41: on Python 3.12 the script pinned torch==2.13.0 from the default index, on Linux PyPI's CUDA
    build (a 4.8 GB environment on a machine without a GPU), with no way to ask for the CPU one. With
    --cpu-torch (the README's test command names it) torch comes from PyTorch's CPU index first, alone
    (its dependencies come from the configured index, under the pins); the rest then keeps it. Issue #49:
    where that index cannot be reached, pip printed 50 retry warnings before its fallback; the script now
    says so in one line and takes the configured index. Every pip call installs under tests/constraints.txt.
    A stand-in Python answers the script's checks (no torch installed yet) and records each pip call instead
    of running it; a local HTTP server stands in for the CPU index (a closed port for one out of reach)."""
    import http.server
    import os
    import platform
    import socket
    import subprocess
    import sys
    import threading

    if platform.system() != "Linux":
        pytest.skip("the CPU index is taken on Linux, where PyPI's torch is a CUDA build")
    assert "--cpu-torch" in _one_line(README[README.index("## The two commands"):README.index("## Install and patch")])
    (tmp_path / "index" / "torch").mkdir(parents=True)
    server = None
    if index == "reachable":
        handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
    else:
        with socket.socket() as s:  # a port nothing listens on: refused at once
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then case "$2" in *find_spec*) echo none; exit 0;; esac; '
                    f'exec "{sys.executable}" "$@"; fi\necho "$*" >> "{calls}"\n')
    fake.chmod(0o755)
    try:
        r = subprocess.run(["bash", str(ROOT / "tests" / "install_deps.sh"), *([flag] if flag else [])],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHON": str(fake), "CPU_TORCH_INDEX": url})
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    assert r.returncode == 0, (r.stdout, r.stderr)
    pips = [line.split() for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    cpu = ["-m", "pip", "install", "-q", "--no-deps", "torch==2.13.0", "--index-url", url]
    rest = ["-m", "pip", "install", "-q", "-c", "tests/constraints.txt", "torch==2.13.0", "-e", ".[test]", "packaging",
            "numpy"]
    assert pips[:2] == ([cpu, rest] if index == "reachable" else [rest, pips[1]]), pips
    assert all(p[4:6] == ["-c", "tests/constraints.txt"] for p in pips if p != cpu), pips  # every other call: pinned
    assert index == "reachable" or not any("--index-url" in p for p in pips), pips
    assert "tests/install_deps.sh: installed torch none build" in r.stdout  # says which build (none: the stand-in)
    if index == "unreachable":
        said = [line for line in r.stdout.splitlines() if "cannot be reached" in line]
        assert len(said) == 1 and "Connection refused" in said[0] and "from the configured index" in said[0], r.stdout
        assert r.stderr == "", r.stderr


def test_the_training_curve_table_is_its_result_file_and_names_the_machine():
    """Issue #25: the table came out 6.2e-6 to 7.6e-6 on an Intel Xeon against the README's 5.4e-7 to
    2.1e-6 (AMD EPYC): the README names the machine of its figures, and they are the result file's."""
    import json

    result = json.loads((ROOT / "benchmarks" / "results" / "train_curve.json").read_text())
    text = _one_line(PERFORMANCE_DOC)
    section = text[text.index("**Training curve**"):text.index("**The full layer**")]
    assert f"measured on an {result['machine']['cpu_model']} VM" in section
    assert result["versions"]["torch"] in section and "another CPU" in section
    rows = dict(re.findall(r"\| CP=2 ([^|]+?) \| ([0-9.e-]+) \|", section))
    names = {"headwise": "cp2-headwise", "chunkwise (swap at hidden_states)": "cp2-chunkwise",
             "chunkwise (swap at the core)": "cp2-chunkwise-core", "all_gather": "cp2-all_gather"}
    assert set(rows) == set(names), rows
    for row, key in names.items():
        assert float(rows[row]) == float(f"{result['max_rel_diff_loss'][key]:.1e}"), (row, rows[row])
        assert result["max_rel_diff_loss"][key] <= result["target"]["max_rel_diff_loss"]


# ------------------------------------------------------------------------------------------
# "Train a model with Megatron-LM": the command is the one that ran, and its figures are the result file's
# ------------------------------------------------------------------------------------------
def test_the_training_command_is_the_run_that_matched_cp1():
    """The README's command is exactly what the launcher ran for the result file's ``hybrid_cp2_chunkwise``
    row (its ``args``, minus what ranks sharing one GPU add), and that row matched CP=1 under the rule the
    file was written with."""
    import json

    from benchmarks.train_megatron_lm import judge

    from tests.megatron.test_training_args import readme_training_command

    command = readme_training_command()
    env, args = command["env"], command["args"]
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and command["nproc"] == 2
    result = json.loads((ROOT / "benchmarks" / "results" / "train_megatron_lm.json").read_text())
    judge(result["rows"], result["rule"])
    (row,) = [r for r in result["rows"] if r["name"] == "hybrid_cp2_chunkwise"]
    ran = list(row["args"])
    cut = ran.index("--distributed-backend")
    assert ran[cut:cut + 4] == ["--distributed-backend", "gloo", "--cp-comm-type", "a2a"], ran
    ran = ran[:cut] + ran[cut + 4:]
    # the data folder the launcher wrote ($DATA in the README), one index cache per run there (one in the README)
    data = ran[ran.index("--data-path") + 1].rsplit("/", 1)[0]
    ran = [a.replace(data, "PLACEHOLDER_DATA") for a in ran]
    ran[ran.index("--data-cache-path") + 1] = "PLACEHOLDER_DATA/cache"
    assert args == ran, args
    assert row["verdict"] == "matches CP=1" and row["cp"] == 2 and row["mode"] == "chunkwise", row


def _sci(x: float) -> str:
    """1.1e-4, as the README writes it (Python's 1.1e-04 without the exponent's leading zero)."""
    return re.sub(r"e([-+])0(\d)", r"e\1\2", f"{x:.1e}")


def _own_pair_first_over(rows: list, by: dict, name: str):
    """The first iteration a bf16 CP > 1 row's loss leaves max(2e-3, 3x the running maximum of its own model's
    noise pair) (None: it never does): the file's rule with the pair of the row's model only."""
    from benchmarks.mlm_verdict import rel_diffs

    r = by[name]
    ref, pair = by[r["reference"]], by[r["reference"] + "_noise"]
    band, run_max = [], 0.0
    for d in rel_diffs(pair["losses"], ref["losses"]):
        run_max = max(run_max, d)
        band.append(max(2e-3, 3 * run_max))
    over = [i + 1 for i, d in enumerate(rel_diffs(r["losses"], ref["losses"])) if d > band[i]]
    return over[0] if over else None


def test_the_training_figures_are_the_result_files():
    """Issue 47: the README's training claim says what benchmarks/results/train_megatron_lm.json shows, the rows that
    differ or did not run included: iteration 1 against the noise pair and stock; the file's own rule (rows that
    left it or did not start named); each hybrid row against its own model's pair (the rows that leave that band
    named, with the iteration); the grad norm's largest move against the pairs'; the fp32 rows (over 1e-4, out of
    memory, not started)."""
    import json

    from benchmarks.train_megatron_lm import judge

    result = json.loads((ROOT / "benchmarks" / "results" / "train_megatron_lm.json").read_text())
    # the verdicts under the rule the file names, recomputed now
    judge(result["rows"], result["rule"])
    rows, by = result["rows"], {r["name"]: r for r in result["rows"]}
    bf16 = [r for r in rows if r["cp"] > 1 and r["precision"] == "bf16" and not r.get("stock")]
    matched = [r for r in bf16 if r.get("verdict") == "matches CP=1"]
    text = _one_line(README)
    claim = text[text.index("**CP=2/4 equals CP=1**"):text.index("**Packed sequences (THD)**")]
    named = set(re.findall(r"`((?:hybrid|gpt)_cp\d_\w+)`", claim))
    for r in matched:  # the sizes the README states
        assert (r["seq_length"], r["micro_batch"], r["hidden"], list(r["gdn_heads"]), r["gdn_head_dim"]) == (
            4096, 2, 1024, [4, 12], 128), r["name"]
    noise = max(r["loss_rel_diff_it1"] for r in rows if r.get("verdict") == "noise pair" and r["precision"] == "bf16")
    stock = {r["model"]: r["loss_rel_diff_it1"] for r in rows if r.get("verdict", "").startswith("stock: ")}
    assert (f"CP=1's loss within {_sci(max(r['loss_rel_diff_it1'] for r in matched))} at iteration 1 (two CP=1 runs: "
            f"{_sci(noise)} apart; stock megatron-core at CP=2: {_sci(stock['hybrid'])}") in text
    assert f"(stock at CP=2: {_sci(stock['hybrid'])} hybrid, {_sci(stock['gpt'])} GPT)" in text  # "Results in brief"
    # the file's rule: every row that did not match it is named, and how many did
    assert f"{len(matched)} of the {sum(r['status'] == 'ok' for r in bf16)} runs that started match" in claim
    assert {r["name"] for r in bf16 if r.get("verdict") != "matches CP=1"} <= named
    # against its own model's pair
    own = {r["name"]: _own_pair_first_over(rows, by, r["name"]) for r in bf16 if r["status"] == "ok"}
    left = {n: it for n, it in own.items() if it and n.startswith("hybrid")}
    assert f"{len(left)} of the {sum(n.startswith('hybrid') for n in own)} hybrid runs leave that band" in claim
    for n, it in left.items():
        assert n in named and re.search(rf"`{n}`[^;]*? at (iteration )?{it}\b", claim), (n, it)
    # the grad norm, never judged by the file's rule
    gn = max(bf16, key=lambda r: r.get("grad_norm_rel_diff") or 0)
    worst = max(range(len(gn["grad_norms"])), key=lambda i: abs(gn["grad_norms"][i] / by[gn["reference"]]["grad_norms"][i] - 1))
    pair_gn = max(r["grad_norm_rel_diff"] for r in rows if r.get("verdict") == "noise pair" and r["precision"] == "bf16")
    assert (f"grad norm moves up to {round(100 * gn['grad_norm_rel_diff'])}% from CP=1's (`{gn['name']}` at iteration "
            f"{worst + 1}) where a noise pair moves at most {round(100 * pair_gn)}%") in claim
    # fp32: over the file's 1e-4, out of memory, not started
    fp32 = {r["name"]: r for r in rows if r["precision"] == "fp32" and r["cp"] > 1}
    ran = [r for r in fp32.values() if r["status"] == "ok"]
    assert all(r["verdict"] == "differs from CP=1" for r in ran) and {r["cp"] for r in ran} == {2}
    assert (f"CP=2 starts {_sci(max(r['loss_rel_diff_it1'] for r in ran))} from CP=1 and goes over the file's 1e-4 at "
            f"iteration {min(r['first_iteration_over'] for r in ran)} (at most {_sci(max(r['loss_rel_diff'] for r in ran))}; "
            f"two fp32 CP=1 runs: {_sci(by['gdnonly_fp32_cp1_noise']['loss_rel_diff'])} apart)") in claim
    assert all("out of memory" in r["error"] for r in fp32.values() if r["cp"] == 4) and "at CP=4 ran out of GPU memory" in claim
    assert fp32["gdnonly_fp32_cp2_all_gather"]["status"] == "not run (budget)" and "all_gather at CP=2 did not start" in claim
    # the rerun (rule pairs_band): started, its rows in the pending file; what they show so far is stated from them
    assert result.get("rule") != "pairs_band" and "has not run yet" not in claim
    pending = json.loads((ROOT / "benchmarks" / "results" / "runs" / "train_megatron_lm_pending.json").read_text())
    assert pending["rule"] == "pairs_band"
    p = {r["name"]: r for r in pending["rows"]}
    assert f"has started (one H100, 2026-12-07, {len(p)} of its rows)" in claim
    cp2, cp1 = p["hybrid_cp2_chunkwise"], p["hybrid_cp1"]
    pairs = [r for r in pending["rows"] if r["reference"] == "hybrid_cp1" and r.get("verdict") == "noise pair"]
    assert cp2["verdict"] == "differs from CP=1" and len(pairs) == 4
    assert (f"its loss is {cp2['losses'][0]} against CP=1's {cp1['losses'][0]} (four noise pairs: "
            f"{' and '.join(sorted({str(r['losses'][0]) for r in pairs}))}) and its grad norm {cp2['grad_norms'][0]} "
            f"against {cp1['grad_norms'][0]} (pairs {min(r['grad_norms'][0] for r in pairs):.3f}-"
            f"{max(r['grad_norms'][0] for r in pairs):.3f})") in claim
    band = cp2["left_band"]["loss"]
    assert (f"its loss leaves the band at iteration {band['iteration']} ({band['diff']:.2e} against "
            f"{band['band']:.1e})").replace("e-0", "e-") in claim
    nogdn, nogdn1 = p["nogdn_cp2"], p["nogdn_cp1"]
    assert nogdn["losses"][:2] == nogdn1["losses"][:2] and "gives CP=1's loss to the printed digit at iterations 1 and 2" in claim
    # the per-parameter gradients (gdn_cp_testing.megatron.wgrads, run 2026-12-07t; run o had the same at iteration 1)
    wg = json.loads((ROOT / "benchmarks" / "results" / "runs" / "run_2026-12-07t" / "wgrads.json").read_text())
    rel = {key.split(" vs ")[0]: c["rel"] for key, c in wg["compared"].items() if key.endswith(" @1")
           and not key.endswith("gdn_cp @1")}
    on_path = {key.split(" vs ")[0]: c["rel"] for key, c in wg["compared"].items() if key.endswith("hybrid_cp1_gdn_cp @1")}
    last = {key.split(" vs ")[0] + (" path" if "gdn_cp @" in key else ""): c["rel"] for key, c in wg["compared"].items()
            if key.endswith(" @6")}
    assert (f"Against CP=1 run through gdn-cp's own path ({rel['hybrid_cp1_gdn_cp']:.2e} from stock's CP=1), the SBHD CP=2 "
            f"rows are {on_path['hybrid_cp2_chunkwise']:.2e} (chunkwise) and {on_path['hybrid_cp2_headwise']:.2e} (headwise) "
            f"away: Megatron's own CP floor").replace("e-0", "e-") in claim
    assert max(on_path.values()) < 1.15 * rel["nogdn_cp2"]
    assert (f"by iteration 6 the SwiGLU pair is {last['hybrid_cp1_swiglu_noise']:.2e} away, chunkwise "
            f"{last['hybrid_cp2_chunkwise path']:.2e} from gdn-cp's CP=1 path and headwise {last['hybrid_cp2_headwise path']:.2e}, "
            f"while the model without GDN layers stays at {last['nogdn_cp2']:.2e}").replace("e-0", "e-") in claim
    assert (f"`hybrid_cp2_chunkwise`'s gradient is {rel['hybrid_cp2_chunkwise']:.2e} from CP=1's (relative L2 of the "
            f"whole gradient) where the SwiGLU noise pair's is {rel['hybrid_cp1_swiglu_noise']:.2e}; on packed "
            f"documents, where CP=1 runs gdn-cp's kernels too, CP=2 is {rel['hybrid_idm_cp2']:.2e} from CP=1, as close as "
            f"Megatron's own CP on the model without GDN layers ({rel['nogdn_cp2']:.2e})").replace("e-0", "e-") in claim
    assert rel["hybrid_idm_cp2"] < 1.15 * rel["nogdn_cp2"] < rel["hybrid_cp1_swiglu_noise"] < rel["hybrid_cp2_chunkwise"]


# ------------------------------------------------------------------------------------------
# docs/megatron.md lists the Megatron-LM flags the patch adds (`pretrain_hybrid.py --help` crashes in stock)
# ------------------------------------------------------------------------------------------
def test_the_docs_list_every_flag_the_patch_adds_with_its_values_and_default():
    """Issue #32: `--linear-cp-mode` could not be found with `--help`; each ``linear_cp_*`` field of the
    patched TransformerConfig is a row of docs/megatron.md's flag table, with its values (gdn-cp's
    registries': the patch names none) and default."""
    from gdn_cp.layout.boundaries import THD_SPLITS
    from gdn_cp.modes.spec import MODE_CHOICES
    from gdn_cp.ops.registry import BACKEND_CHOICES

    choices = {"linear_cp_mode": MODE_CHOICES, "linear_cp_backend": BACKEND_CHOICES, "linear_cp_thd_split": THD_SPLITS}
    text = next((patch_dir() / t.patch).read_text() for t in load_manifest().files if t.target.endswith(
        "transformer_config.py"))
    fields = re.findall(r"^\+    (linear_cp_\w+): (.*) = (\S+)$", text, re.M)
    assert {name for name, _, _ in fields} >= {"linear_cp_mode", "linear_cp_thd_split"}, fields
    start = MEGATRON_DOC.index("### The Megatron-LM flags gdn-cp adds")
    section = MEGATRON_DOC[start:MEGATRON_DOC.index("\n## ", start)]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(--[\w-]+)` \|.*$", section, re.M)}
    assert sorted(rows) == sorted("--" + name.replace("_", "-") for name, _, _ in fields), rows
    for name, annotation, default in fields:
        row = rows["--" + name.replace("_", "-")]
        assert "Literal" not in annotation, annotation  # the patch knows no registry
        values = row.split("|")[2]
        assert sorted(re.findall(r"`(\w+)`", values)) == sorted(choices[name]), (row, choices[name])
        assert (f"| `{default.strip(chr(34))}` |" in row) if default != "None" else "| none" in row, (row, default)


# ------------------------------------------------------------------------------------------
# cross-references: the sections, names and result fields the pages point to exist
# ------------------------------------------------------------------------------------------
def _headings(text: str) -> list[str]:
    """Markdown headings of ``text``, outside code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [h.strip() for h in re.findall(r"^#+ (.+)$", prose, re.M)]


def _section_refs() -> list[tuple[str, str, str]]:
    """``(where, page, section name)`` for each section a page or a docstring names: README's X section,
    README "X", `docs/f.md` ("X") / `docs/f.md`, "X", ("X", below|above) and see "X" (the same page)."""
    sources = {name: text for name, text in DOCS.items()}
    for folder in ("gdn_cp", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            sources[str(path.relative_to(ROOT))] = path.read_text()
    refs = []
    for where, text in sources.items():
        flat = _one_line(text)
        own = where if where in DOCS else "README.md"
        for m in re.finditer(r"README's ([A-Z][\w-]*) section", flat):
            refs.append((where, "README.md", m.group(1)))
        for m in re.finditer(r"README(?:'s)?,? \"([^\"]+)\"", flat):
            refs.append((where, "README.md", m.group(1)))
        for m in re.finditer(r"`?(docs/\w+\.md)`?,? \(?\"([^\"]+)\"", flat):
            refs.append((where, m.group(1), m.group(2)))
        for m in re.finditer(r"\(\"([^\"]+)\", (?:below|above)\)|\bsee \"([^\"]+)\"", flat):
            refs.append((where, own, m.group(1) or m.group(2)))
    return refs


def test_every_section_a_page_names_exists():
    """Issue #32: "the README's Performance section" (there is none), "what doctor prints" in
    docs/megatron.md (not there). Every section named by the README, the docs and the code's
    docstrings is a heading of the page named (a part of its title is enough: "which cut")."""
    refs = _section_refs()
    assert len(refs) > 8, refs
    bad = [(where, page, name) for where, page, name in refs
           if not any(name in heading for heading in _headings(DOCS[page]))]
    assert bad == [], bad


def test_each_result_file_has_the_machine_and_versions_the_docs_say_it_has():
    """docs/performance.md: each results JSON has the machine and the versions, except the files it
    names as lacking them (issue #32: syncs.json had no versions while the page said all had)."""
    import json

    text = _one_line(PERFORMANCE_DOC)
    claim = re.search(r"with the machine and versions(?:, except ((?:`\w+\.json`(?:,| and)? ?)+))?", text)
    assert claim, "docs/performance.md no longer says which result files have the machine and versions"
    exceptions = set(re.findall(r"`(\w+\.json)`", claim.group(1) or ""))
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        rows = data if isinstance(data, list) else [data]
        has = all("machine" in r and "versions" in r for r in rows)
        assert has == (path.name not in exceptions), (path.name, has, exceptions)


def test_every_gdn_cp_name_the_docs_and_results_give_exists():
    """Dotted names (``gdn_cp.layout.packings.packed_boundaries``) in the pages and in the result files
    import (issue #32: route_build.json named gdn_cp.demo.packed_boundaries, moved since)."""
    import importlib

    texts = [ALL_DOCS] + [p.read_text() for p in sorted((ROOT / "benchmarks" / "results").glob("*.json"))]
    names = {n for t in texts for n in re.findall(r"(?<![\w.*])gdn_cp(?:\.\w+)+", t)}
    assert len(names) > 5, names
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert missing == [], missing


def test_the_per_rank_figures_are_the_result_file_and_say_how_they_were_taken():
    """README's "per rank" figures (issue #41: said without how they were taken): the TE-spec rows of
    benchmarks/results/layer_full_cp1.json, a CP=1 process on each rank's slice of a CP=2 split."""
    import json

    rows = [r for r in json.loads((ROOT / "benchmarks" / "results" / "layer_full_cp1.json").read_text())
            if r.get("spec") == "te" and r["T"] == 32768 and r["status"] == "ok"]
    assert rows and {r["cp"] for r in rows} == {1} and {r["slice_of_cp"] for r in rows} == {2}

    def row(case, rank, norm):
        (found,) = [r for r in rows if r["case"] == case and r["slice_rank"] == rank and r["norm_path"].startswith(norm)]
        return found

    ratios = [row("patched_slice", k, "fused")["median_ms"] / row("stock_slice", k, "stock")["median_ms"]
              for k in (0, 1)]
    memory = {round(row("patched_slice", k, "fused")["peak_gib"] / row("stock_slice", k, "stock")["peak_gib"], 3)
              for k in (0, 1)}
    unfused = {round(row("patched_slice", k, "unfused")["median_ms"] / row("patched_slice", k, "fused")["median_ms"], 2)
               for k in (0, 1)}
    text = _one_line(README)
    span = f"{min(ratios):.3f}-{max(ratios):.3f}x"
    assert f"| {span} stock's time, {memory.pop():.3f}x its peak memory; {unfused.pop():.2f}x slower with gdn-cp's " \
           "fused gated norm off |" in text and not memory and not unfused


def test_the_glue_per_rank_figures_are_their_result_file():
    """README's per-rank figures with the default glue: benchmarks/results/layer_full_glue.json (runs 2026-12-04c/d,
    2026-12-05a and g-i, 2026-12-06a/b/d/e/j-o, 2026-12-07a), each rank's slice of a CP=2 split at CP=1: the default glue
    (``CUDA_DEFAULT``, q and k repeated by the conv for FLA 0.4.2) against stock (the newest run that has the row)
    and against the path it replaced; the copies against the backend's; the older paths against theirs (in the runs
    that timed both)."""
    import json

    from gdn_cp.ops.fused import CUDA_DEFAULT, triton_conv
    from gdn_cp_testing.results import (COPY_LEVERS, HALO_LEVERS, KEY_HEAD_LEVERS, default_key_heads_in_glue,
                                        halo_rows_apart, key_heads_in_glue, picks_glue_path, scan_branch_masks)

    def glue_only(lever):  # rows that change the glue only (the copies' form: its own sentence, below)
        return lever in (None, *KEY_HEAD_LEVERS, *HALO_LEVERS) or picks_glue_path(lever)

    # the halo as today's default reads it (run 2026-12-07q: its halo_in_tiles rows are the default's now)
    rows = [r for r in json.loads((ROOT / "benchmarks" / "results" / "layer_full_glue.json").read_text())
            if r["status"] == "ok" and glue_only(r.get("lever_off"))
            and (r["case"] == "stock_slice" or (halo_rows_apart(r), scan_branch_masks(r)) == (
                triton_conv.HALO_ROWS_APART, triton_conv.SCAN_BRANCH_MASKS))]
    assert {r["cp"] for r in rows} == {1} and {r["slice_of_cp"] for r in rows} == {2}

    def matching(spec, t, case, rank, backend, glue=None, run=None, gpu="", heads=None):  # heads None: the default's
        return [r for r in rows if r["spec"] == spec and r["T"] == t and r["case"] == case and r["slice_rank"] == rank
                and r["knobs"]["linear_cp_backend"] == backend and r.get("glue") == glue and run in (None, r["run_id"])
                and gpu in r["versions"]["gpu"] and key_heads_in_glue(r) == (
                    (glue == CUDA_DEFAULT and default_key_heads_in_glue(r["stack"], backend)) if heads is None else heads)]

    def row(spec, t, case, rank, backend, glue=None, run=None, gpu="", heads=None):
        found = matching(spec, t, case, rank, backend, glue, run, gpu, heads)
        newest = max(r["run_id"] for r in found)
        (one,) = [r for r in found if r["run_id"] == newest]
        return one

    def vs_stock(spec, t, rank, backend, key="median_ms", gpu="H100"):  # the newest run on that GPU
        gdn_cp = row(spec, t, "patched_slice", rank, backend, CUDA_DEFAULT, gpu=gpu)
        return gdn_cp[key] / row(spec, t, "stock_slice", rank, backend, run=gdn_cp["run_id"])[key]

    def both_rows(spec, t, rank, backend, path, other, heads=(False, False)):  # in the newest run that timed both
        both = set.intersection(*({r["run_id"] for r in matching(spec, t, "patched_slice", rank, backend, g, heads=h)}
                                  for g, h in zip((path, other), heads)))
        run = max(both)
        return [row(spec, t, "patched_slice", rank, backend, g, run, heads=h) for g, h in zip((path, other), heads)]

    def vs_path(*unit_and_paths, heads=(False, False), same_peak=False):
        ours, theirs = both_rows(*unit_and_paths, heads=heads)
        assert not same_peak or abs(ours["peak_gib"] - theirs["peak_gib"]) < 1e-3  # "at the same peak memory"
        return ours["median_ms"] / theirs["median_ms"]

    def span(values):
        return f"{min(values):.3f}-{max(values):.3f}x"

    ratio = {t: [vs_stock("local", t, k, "flashqla") for k in (0, 1)] for t in (32768, 131072)}
    memory = [vs_stock("local", t, k, "flashqla", "peak_gib") for t in (32768, 131072) for k in (0, 1)]
    fla = [vs_stock("local", 32768, k, "fla") for k in (0, 1)]
    fla_te = {t: [vs_stock("te", t, k, "fla") for k in (0, 1)] for t in (32768, 131072)}
    qla_te = {t: [vs_stock("te", t, k, "flashqla") for k in (0, 1)] for t in (32768, 131072)}
    scan_units = [("local", t, k, "flashqla") for t in (32768, 131072) for k in (0, 1)]
    scan_units += [("local", 32768, k, "fla") for k in (0, 1)]
    vs_dz_copy = [vs_path(*unit, CUDA_DEFAULT, "triton_norm_dz_copy", same_peak=True) for unit in scan_units]
    te_units = [("te", t, k, "fla") for t in (32768, 131072) for k in (0, 1)]  # run 2026-12-07a: copies in both
    vs_dz_copy += [vs_path(*unit, CUDA_DEFAULT, "triton_norm_dz_copy", heads=(True, True), same_peak=True)
                   for unit in te_units]
    vs_backend = [vs_path("local", 32768, k, "fla", p, p, heads=(True, False), same_peak=True) for k in (0, 1)
                  for p in (CUDA_DEFAULT, "triton_norm_dz_copy")]
    vs_backend += [vs_path(*unit, CUDA_DEFAULT, CUDA_DEFAULT, heads=(True, False), same_peak=True) for unit in te_units]
    units = [("local", t, k, "flashqla") for t in (32768, 131072) for k in (0, 1)]
    units += [("te", t, k, "fla") for t in (32768, 131072) for k in (0, 1)]
    vs_one_pass = [vs_path(*unit, "triton_norm_dz_copy", "triton_one_pass", same_peak=True) for unit in units]
    vs_two_pass = [vs_path(*unit, "triton_one_pass", "triton") for unit in units + [("te", 32768, 0, "flashqla")]]
    vs_unfused = [vs_path("te", 32768, k, "fla", "triton_one_pass", "unfused") for k in (0, 1)]
    text = _one_line(README)
    assert (f"**Per rank, with gdn-cp's Triton glue (the default)**: on FlashQLA, {span(ratio[32768])} of stock's "
            f"time at 32K tokens and {span(ratio[131072])} at 128K, {span(memory)} its peak memory (Megatron's local "
            f"modules), and with the TE spec {span(qla_te[32768])} at 32K and {span(qla_te[131072])} at 128K; on FLA "
            f"0.4.2, {span(fla)} at 32K with the local modules and, with the TE spec, {span(fla_te[32768])} at 32K and "
            f"{span(fla_te[131072])} at 128K (one H100, 2026-12-06 and 07)") in text
    wide_rows = [r for r in json.loads((ROOT / "benchmarks" / "results" / "layer_full_glue.json").read_text())
                 if r["status"] == "ok" and r.get("lever_off") == COPY_LEVERS[0]]  # runs 2026-12-07d/e
    wide_vs = [w["median_ms"] / row(w["spec"], w["T"], "patched_slice", w["slice_rank"], w["gdn_cp_backend"],
                                    CUDA_DEFAULT, run=w["run_id"])["median_ms"] for w in wide_rows]
    assert len(wide_vs) == 6, wide_vs
    assert (f"since 2026-12-07 they go as 8-byte words, {span(wide_vs)} the layer's time in the {len(wide_vs)} rank rows "
            "that timed both (the TE spec, FLA and FlashQLA), at the same peak memory") in text
    assert (f"The default (`triton_norm_dz_copy_scan`, since 2026-12-06: the conv's backward as a scan down the rows) "
            f"is {span(vs_dz_copy)} the time of the path it replaced, `triton_norm_dz_copy`, and q and k repeated by "
            f"the conv for FLA 0.4.2 (no grouped value heads) {span(vs_backend)} the time of the backend's copies, "
            "each at the same peak memory") in text
    assert (f"Before it, `triton_norm_dz_copy` was {span(vs_one_pass)} the time of the one-pass path, whose backward "
            f"was {span(vs_two_pass)} the time of the two-pass one, and whose glue was {span(vs_unfused)} the unfused "
            "glue's") in text
    assert (f"| per rank, FlashQLA + Triton glue (default path), local modules, 32K / 128K, one H100 | "
            f"{span(ratio[32768])} / {span(ratio[131072])} stock's time, {span(memory)} its peak memory |") in text
    memory_qla_te = [vs_stock("te", t, k, "flashqla", "peak_gib") for t in (32768, 131072) for k in (0, 1)]
    assert (f"| per rank, FlashQLA + Triton glue (default path), TE spec, 32K / 128K, one H100 | "
            f"{span(qla_te[32768])} / {span(qla_te[131072])} stock's time, {span(memory_qla_te)} its peak memory |") in text
    memory_te = [vs_stock("te", t, k, "fla", "peak_gib") for t in (32768, 131072) for k in (0, 1)]
    assert (f"| per rank, FLA 0.4.2 + Triton glue (default path), TE spec, 32K / 128K, one H100 | "
            f"{span(fla_te[32768])} / {span(fla_te[131072])} stock's time, {span(memory_te)} its peak memory |") in text
    norm_time = {t: [row("local", t, "patched_slice", k, "flashqla", "triton_norm") for k in (0, 1)]
                 for t in (32768, 131072)}
    stock_of = {t: [row("local", t, "stock_slice", k, "flashqla", run=r["run_id"]) for k, r in enumerate(norm_time[t])]
                for t in norm_time}
    time_ = {t: [r["median_ms"] / s["median_ms"] for r, s in zip(norm_time[t], stock_of[t])] for t in norm_time}
    mem = {t: [r["peak_gib"] / s["peak_gib"] for r, s in zip(norm_time[t], stock_of[t])] for t in norm_time}
    assert (f"`GDN_CP_GLUE=triton_norm` (not the default: it trades memory for time) is {span(time_[32768])} of "
            f"stock's time at 32K and {span(time_[131072])} at 128K, with {span(mem[32768])} and {span(mem[131072])} "
            "its peak memory") in text
    assert ("a CP=1 process run on one rank's slice of the rows of a CP=2 split, gdn-cp and stock on the same rows "
            "and weights (`benchmarks/layer_full.py --cp 1 --slice-of-cp 2`), not a CP run") in text


def test_the_package_says_what_it_is():
    """Issue #41: no LICENSE although pyproject declares Apache-2.0, no CHANGELOG. The LICENSE is the
    Apache License 2.0's text, the CHANGELOG's newest release is gdn_cp.__version__, and the torch floor
    pyproject declares is the one the docs give (megatron-core 0.19.2's)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and len(license_text) > 10000  # the whole text
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == gdn_cp.__version__, releases
    (torch,) = [d for d in project["dependencies"] if d.startswith("torch")]
    floor = torch.split(">=")[1]
    for name in ("README.md", "docs/megatron.md"):
        assert f"pip keeps any torch >= {floor}" in _one_line(DOCS[name]), name


def test_the_sync_and_route_build_figures_are_their_result_files():
    """README's "0 in every mode ... on FLA and on FlashQLA (stock: 5 in the forward)" and "Stock makes 5 per forward"
    are benchmarks/results/syncs.json (FLA) and syncs_flashqla.json (runs 2026-12-07m, l); "0.108 ms
    against stock's per-token 23.2 ms" (T=1M, 64 sequences, cp=8) is route_build.json's plan + index and per-token
    times (issue #41: every figure from a file)."""
    import json

    stock = set()
    for name, backend in (("syncs.json", "fla"), ("syncs_flashqla.json", "flashqla")):
        doc = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        syncs = doc["cp"]
        ours = {n for per_cp in syncs.values() for mode, c in per_cp.items() if not mode.startswith("stock")
                for n in (c["forward"], c["backward"])}
        modes = {mode for per_cp in syncs.values() for mode in per_cp}
        assert ours == {0} and sorted(syncs) == ["1", "2"] and doc["linear_cp_backend"] == backend, (name, ours)
        assert {"headwise", "chunkwise", "chunkwise generic", "all_gather"} <= modes, (name, modes)
        assert doc["versions"]["gpu"].startswith("NVIDIA H100") and doc["versions"]["gdn_cp"], doc["versions"]
        stock |= {per_cp["stock headwise"]["forward"] for per_cp in syncs.values() if "stock headwise" in per_cp}
    assert len(stock) == 1, stock
    text = _one_line(README)
    assert (f"| 0 in every mode, forward and backward, on FLA and on FlashQLA (stock: {stock.pop()} in the forward), "
            "CP=1 and 2, Triton glue, one H100, 2026-12-07 |") in text
    assert f"Stock makes {max(per_cp['stock headwise']['forward'] for per_cp in syncs.values())} per forward" in text
    build = json.loads((ROOT / "benchmarks" / "results" / "route_build.json").read_text())["results"]
    (row,) = [r for r in build if (r["T_global"], r["num_sequences"], r["cp"]) == (1 << 20, 64, 8)]
    assert (f"| route build, T=1M, 64 sequences, cp=8 | {row['plan_index_ms']:.3f} ms against stock's per-token "
            f"{row['per_token_ms']:.1f} ms |") in text


def test_the_fla060_per_rank_figure_is_its_result_file():
    """README's "0.852-0.872x stock's time on the same stack at 32K" (local modules, FLA 0.6): gdn-cp over
    stock on the same rows, whole (CP=1) and each rank's slice, in layer_full_cp1_fla060.json."""
    import json

    rows = [r for r in json.loads((ROOT / "benchmarks" / "results" / "layer_full_cp1_fla060.json").read_text())
            if r["T"] == 32768 and r["status"] == "ok"]
    ms = {(r["case"].split("_")[0], r["case"].split("_")[1], r.get("slice_rank")): r["median_ms"] for r in rows}
    ratios = [ms[("patched", kind, rank)] / ms[("stock", kind, rank)]
              for kind, rank in (("cp1", None), ("slice", 0), ("slice", 1))]
    assert (f"| per rank, local modules, FLA 0.6 | {min(ratios):.3f}-{max(ratios):.3f}x stock's time on the same "
            "stack at 32K |") in _one_line(README)


def test_the_pad_cost_figures_are_their_result_file():
    """docs/megatron.md's pad shares at CP=8 and 32K tokens a row (TP 1) per document mix, and README's
    "0.1-4.2% more tokens at CP=8" (their range), are benchmarks/results/pad_cost.json's."""
    import json

    rows = json.loads((ROOT / "benchmarks" / "results" / "pad_cost.json").read_text())["rows"]
    share = {r["mix"]: 100 * r["pad_fraction"] for r in rows if (r["cp"], r["seq"], r["tp_sp"]) == (8, 32768, 1)}
    assert set(share) == {"mock", "web", "short", "long"}, share
    doc = _one_line(MEGATRON_DOC)
    assert (f"at CP=8 and 32K tokens a row, {share['mock']:.2f}% of the tokens for Megatron-LM's mock data" in doc
            and f"{share['web']:.2f}% for a web-like mix" in doc and f"{share['short']:.1f}% for short documents"
            in doc and f"{share['long']:.1f}% for long ones" in doc), share
    assert f"costs {min(share.values()):.1f}-{max(share.values()):.1f}% more tokens at CP=8" in _one_line(README)
