"""The patched megatron-core imports and behaves: TransformerConfig checks linear_cp_mode through gdn_cp,
GatedDeltaNet.forward hands over (or says how to install gdn_cp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_cp.patch import apply_patch

from .conftest import started_runs
from .sources import REPO, Layout


# One Python runs every job of this module (a fresh one costs seconds of torch and megatron
# imports; megatron alone again, from another tree, costs a fraction of a second): each job first
# drops megatron's modules and puts its tree first on sys.path.
_SCRIPT = r"""
import json, sys, traceback, typing, warnings
warnings.filterwarnings("ignore")
import torch
import torch.nn.functional as F
from gdn_cp_testing import lazy_compile; lazy_compile.install()  # megatron's import without TorchInductor's


def use_tree(root):
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    sys.path[:] = [root] + [p for p in sys.path if p not in TREES]
    import megatron.core
    assert megatron.core.__file__.startswith(root), megatron.core.__file__


def table(shapes, modes):
    from megatron.core.transformer import TransformerConfig
    from gdn_cp.modes import spec
    fields = TransformerConfig.__dataclass_fields__
    field = fields.get("linear_cp_mode")
    out = [None if field is None else
           [str(fields[name].type) for name in ("linear_cp_mode", "linear_cp_backend", "linear_cp_thd_split")]]
    # a mode added to gdn-cp's registry: taken by the patched config as it is (the patch names no mode)
    spec.MODES["ring"] = spec.ModeSpec(name="ring", divides_by_cp=False, cost="a test mode", auto_rank=9)
    try:  # megatron-core itself refuses sequence parallelism without TP > 1
        TransformerConfig(num_layers=4, hidden_size=96, num_attention_heads=24, sequence_parallel=True)
        out.append("sp-accepted")
    except ValueError as e:
        out.append(str(e))
    for k, v, tp, cp in shapes:
        for mode in modes:
            kw = dict(num_layers=4, hidden_size=96, num_attention_heads=24,
                      experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                      linear_num_key_heads=k, linear_num_value_heads=v, activation_func=F.silu,
                      tensor_model_parallel_size=tp, context_parallel_size=cp)
            if mode is not None:
                kw["linear_cp_mode"] = mode
            try:
                c = TransformerConfig(**kw)
                out.append([k, v, tp, cp, mode, "ok", getattr(c, "linear_cp_mode", None)])
            except Exception as e:
                out.append([k, v, tp, cp, mode, type(e).__name__, str(e)])
    del spec.MODES["ring"]
    try:  # TransformerConfig's default activation_func (gelu), with GDN layers
        TransformerConfig(num_layers=4, hidden_size=96, num_attention_heads=24,
                          experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                          linear_num_key_heads=16, linear_num_value_heads=32)
        gelu = "accepted"
    except Exception as e:
        gelu = [type(e).__name__, str(e)]
    return {"rows": out, "gelu": gelu}


def forward(root):
    import types
    import gdn_cp.megatron
    from megatron.core.ssm.gated_delta_net import gdn as gdn_mod
    from megatron.core.packed_seq_params import PackedSeqParams
    assert gdn_mod.__file__.startswith(root), gdn_mod.__file__
    forward = gdn_mod.GatedDeltaNet.forward

    calls = []
    fake = types.ModuleType("gdn_cp.megatron.hooks")
    def gated_delta_net_forward(self, hidden_states, attention_mask, **kw):
        calls.append(("forward", self, hidden_states, attention_mask, kw))
        return ("OUT", "BIAS") if self.dispatch else None  # None: the stock code runs
    fake.gated_delta_net_forward = gated_delta_net_forward
    sys.modules["gdn_cp.megatron.hooks"] = gdn_cp.megatron.hooks = fake  # the table job imported the real one

    class FakeGDN:  # the stock path needs far more than this: it fails on self.sp_size
        dispatch = True
    me = FakeGDN()
    hs, mask = torch.zeros(4, 1, 8), None
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32))

    # 1. dispatch: everything is handed over, stock code does not run
    out = forward(me, hs, mask, None, psp, 3, inference_params=None, extra_kw=7)
    assert out == ("OUT", "BIAS"), out
    _, s, h, m, kw = calls[0]
    assert len(calls) == 1 and s is me and h is hs and m is mask
    assert kw == dict(inference_context=None, packed_seq_params=psp, sequence_len_offset=3,
                      inference_params=None, extra_kw=7), kw

    # 2. no dispatch: the stock code below the hook runs
    me.dispatch = False
    calls.clear()
    try:
        forward(me, hs, mask)
        raise SystemExit("stock path did not run")
    except AttributeError as e:
        assert "sp_size" in str(e), e
    assert [c[0] for c in calls] == ["forward"]

    # 3. gdn_cp's hooks not importable: a clear ImportError (the one guard of every patched file)
    sys.modules["gdn_cp.megatron.hooks"] = None
    del gdn_cp.megatron.hooks
    try:
        forward(me, hs, mask)
        raise SystemExit("no ImportError")
    except ImportError as e:
        assert "pip install -e <clone>" in str(e) and "gdn-cp patch revert" in str(e), e
    return "FORWARD-OK"


jobs = json.loads(sys.argv[1])
TREES = {job["root"] for job in jobs}
results = []
for job in jobs:  # the forward job comes last: it replaces gdn_cp.megatron.hooks
    try:
        use_tree(job["root"])
        if job["kind"] == "table":
            results.append(table(job["shapes"], job["modes"]))
        else:
            results.append(forward(job["root"]))
    except BaseException:
        results.append({"error": traceback.format_exc()})
print("RESULT" + json.dumps(results))
"""

_SHAPES = [
    (16, 32, 1, 1),
    (16, 32, 2, 2),
    (16, 32, 2, 8),  # TP*CP = 16 divides K=16 and V=32
    (16, 32, 4, 8),  # TP*CP = 32 does not divide K=16
    (2, 4, 1, 4),
    (2, 4, 2, 2),
    (3, 6, 1, 2),
    (3, 6, 3, 2),
    (4, 12, 2, 1),
    (6, 12, 4, 1),  # TP=4 does not divide K=6
]


STOCK_MODES = [None]
PATCHED_MODES = [None, "headwise", "chunkwise", "all_gather", "auto", "ring", "HEADWISE"]


def start_runs(pristine: Path, base: Path, nice: int = 0) -> tuple[list[str], subprocess.Popen]:
    """Lay out a stock and a patched tree under ``base`` and start the one Python of ``_SCRIPT`` on them (at
    ``nice``): the job names, and the process. ``tests/patch/conftest.py`` starts it in the background (nice 10:
    on what CPU the session's own tests leave) once the sources are there."""
    stock = Layout("site-packages", base / "stock", pristine)
    patched = Layout("site-packages", base / "patched", pristine)
    apply_patch(patched.root)
    jobs = {"table_stock": dict(kind="table", root=str(stock.root), shapes=_SHAPES, modes=STOCK_MODES),
            "table_patched": dict(kind="table", root=str(patched.root), shapes=_SHAPES, modes=PATCHED_MODES),
            "forward": dict(kind="forward", root=str(patched.root))}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(list(jobs.values()))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, cwd=base,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    return list(jobs), proc


@pytest.fixture(scope="module")
def runs(pristine_megatron, tmp_path_factory) -> dict:
    """The jobs' results: ``table_stock`` (a pristine site-packages tree), ``table_patched`` and
    ``forward`` (a patched one), from one Python (see ``_SCRIPT``), started in the background if it was."""
    names, proc = started_runs() or start_runs(pristine_megatron, tmp_path_factory.mktemp("runs"))
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-3000:]
    return dict(zip(names, json.loads(lines[0][len("RESULT"):])))


def _table(result) -> tuple:
    assert "error" not in result, result["error"]
    literal, sp_error, *rows = result["rows"]
    assert sp_error == "Cannot use sequence parallelism without tensor parallelism", sp_error
    return literal, rows, result["gelu"]


@pytest.mark.megatron
def test_patched_transformer_config_validation_table(runs):
    from gdn_cp.megatron.config import resolve_linear_cp_mode

    literal, stock, gelu = _table(runs["table_stock"])
    assert literal is None  # no linear_cp_mode field before patching
    assert gelu == "accepted"  # stock refuses a non-SiLU GDN activation only when the layer runs
    for k, v, tp, cp, _, outcome, detail in stock:  # stock 0.19.2: heads % (TP*CP), AssertionError
        ok = k % (tp * cp) == 0 and v % (tp * cp) == 0
        assert outcome == ("ok" if ok else "AssertionError"), (k, v, tp, cp, outcome, detail)

    modes = PATCHED_MODES
    types, rows, gelu = _table(runs["table_patched"])
    # plain strings: the patch names no mode and no backend (argparse gets no choices from it)
    assert types == ["<class 'str'>", "<class 'str'>", "typing.Optional[str]"], types
    assert gelu[0] == "ValueError" and gelu[1].startswith("TransformerConfig.activation_func=gelu, but gated delta "
                                                          "net layers need SiLU"), gelu
    assert len(rows) == len(_SHAPES) * len(modes)
    for k, v, tp, cp, mode, outcome, detail in rows:
        case = (k, v, tp, cp, mode, outcome, detail)
        if mode == "HEADWISE":  # checked against gdn-cp's registry, with its message
            assert outcome == "ValueError", case
            assert "'headwise', 'chunkwise', 'all_gather'" in detail and "'auto'" in detail, case
            continue
        if mode in ("auto", None):  # the field's default is auto: resolved when the config is built
            try:
                want = resolve_linear_cp_mode("auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
            except ValueError:
                assert outcome == "ValueError" and "no mode is legal" in detail and "Fix:" in detail, case
                continue
            assert outcome == "ok" and detail == want, case
            continue
        effective = mode  # "ring" was registered in gdn-cp while the table ran: the same patched files take it
        div = tp * cp if effective == "headwise" else tp
        ok = k % div == 0 and v % div == 0
        if ok:
            assert outcome == "ok" and detail == effective, case
        else:
            assert outcome == "ValueError", case
            assert f"linear_cp_mode={effective!r}" in detail, case
            assert f"tensor_model_parallel_size={tp}" in detail and "Fix:" in detail, case
            bad_field = "linear_num_key_heads" if k % div else "linear_num_value_heads"
            assert f"{bad_field}=" in detail, case


@pytest.mark.megatron
def test_patched_gdn_forward_hands_over(runs):
    assert runs["forward"] == "FORWARD-OK", runs["forward"]
