"""Fuzz ``gdn_cp.megatron.__all__``: ``linear_cp_mode`` checks, resolution and explanation, and the
config hook the patched ``TransformerConfig`` calls, with hostile modes, head counts and sizes.

The independent rule, from the README's mode table: sizes are positive ints, value heads a
multiple of key heads; headwise needs both head counts divisible by TP*CP, chunkwise and
all_gather by TP; ``auto`` picks chunkwise wherever it is legal (whatever the machine), and
refuses when nothing is legal.
"""

from __future__ import annotations

import types

from hypothesis import given
from hypothesis import strategies as st

from gdn_cp.megatron import (
    check_linear_cp_mode,
    configure_linear_cp_mode,
    explain_linear_cp_modes,
    resolve_linear_cp_mode,
)

from .common import (
    MAX_CP,
    MAX_TP,
    assert_accepted,
    assert_refused_naming,
    fuzz_settings,
    hostile_scalars,
    is_int,
    outcome,
)

MODES = ("headwise", "chunkwise", "all_gather")
FIELDS = {  # argument -> the TransformerConfig field its messages name
    "num_key_heads": "linear_num_key_heads",
    "num_value_heads": "linear_num_value_heads",
    "tp": "tensor_model_parallel_size",
    "cp": "context_parallel_size",
}

modes = st.one_of(st.sampled_from(MODES + ("auto",)), st.sampled_from(MODES), hostile_scalars(),
                  st.sampled_from(["Headwise", "head-wise", "auto ", "ring"]))
heads = st.one_of(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]), hostile_scalars())
sizes = st.one_of(st.sampled_from([1, 2, 3, 4, 8]), hostile_scalars())


def legal(mode, k, v, tp, cp) -> bool:
    k, v, tp, cp = int(k), int(v), int(tp), int(cp)  # NumPy integers: no int32 overflow in this check's own math
    div = tp * cp if mode == "headwise" else tp
    return k % div == 0 and v % div == 0


def expected_auto(k, v, tp, cp):
    """chunkwise wherever legal (then all_gather is too, and headwise may be); None: nothing legal."""
    return next((m for m in ("chunkwise", "headwise", "all_gather") if legal(m, k, v, tp, cp)), None)


def bad_size(values: dict, *, config: bool = False):
    """The first argument the rules refuse, by the name its message uses (None: all fine): the
    keyword argument, or with ``config`` (the TransformerConfig hook) the config field."""
    for arg, field in FIELDS.items():
        value = values[arg]
        if not (is_int(value) and value >= 1):
            return field if config else arg
    for arg, limit in (("tp", MAX_TP), ("cp", MAX_CP)):  # README: a CP or TP size above 65536 is refused
        if values[arg] > limit:
            return FIELDS[arg] if config else arg
    if int(values["num_value_heads"]) % int(values["num_key_heads"]):
        return "linear_num_value_heads" if config else "num_value_heads"
    return None


@fuzz_settings(200)
@given(mode=modes, k=heads, v=heads, tp=sizes, cp=sizes)
def test_resolve_and_check(mode, k, v, tp, cp):
    values = dict(num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    is_mode = isinstance(mode, str) and mode in MODES
    is_auto = isinstance(mode, str) and mode == "auto"

    result = outcome(lambda: check_linear_cp_mode(mode, **values))
    size_problem = bad_size(values)
    if not is_mode:
        assert_refused_naming(result, "linear_cp_mode")
    elif size_problem:
        assert_refused_naming(result, size_problem)
    elif not legal(mode, k, v, tp, cp):
        assert_refused_naming(result, "linear_cp_mode")
    else:
        assert assert_accepted(result) == mode

    result = outcome(lambda: resolve_linear_cp_mode(mode, **values))
    if not (is_mode or is_auto):
        assert_refused_naming(result, "linear_cp_mode")
    elif size_problem:
        assert_refused_naming(result, size_problem)
    elif is_mode:
        if legal(mode, k, v, tp, cp):
            assert assert_accepted(result) == mode
        else:
            assert_refused_naming(result, "linear_cp_mode")
    else:
        want = expected_auto(k, v, tp, cp)
        if want is None:
            assert_refused_naming(result, "linear_cp_mode='auto': no mode is legal")
        else:
            assert assert_accepted(result) == want


@fuzz_settings(120)
@given(k=heads, v=heads, tp=sizes, cp=sizes)
def test_explain(k, v, tp, cp):
    values = dict(num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    result = outcome(lambda: explain_linear_cp_modes(**values))
    problem = bad_size(values)
    if problem:
        assert_refused_naming(result, problem)
        return
    report = assert_accepted(result)
    for mode in MODES:
        assert report[mode]["legal"] == legal(mode, k, v, tp, cp), (mode, report[mode])
    assert report["auto"]["resolved"] == expected_auto(k, v, tp, cp)
    assert report["auto"]["legal"] == (report["auto"]["resolved"] is not None)


@fuzz_settings(150)
@given(mode=st.one_of(modes, st.just(None)), k=heads, v=heads, tp=sizes, cp=sizes,
       variant=st.sampled_from(["gated_delta_net", None, "dsa"]), hybrid=st.booleans())
def test_configure_hook(mode, k, v, tp, cp, variant, hybrid):
    """The patched TransformerConfig's hook (docs/megatron.md): a config that
    builds GDN layers is checked and auto resolved (to a legal mode, stored on the config); a hybrid
    model has auto resolved where some mode is legal and kept otherwise (its GDN layers check);
    any other config only refuses unknown modes. (The activation must be SiLU: test_activation.py.)"""
    import torch.nn.functional as F

    config = types.SimpleNamespace(
        linear_cp_mode=mode, linear_num_key_heads=k, linear_num_value_heads=v, tensor_model_parallel_size=tp,
        context_parallel_size=cp, experimental_attention_variant=variant, is_hybrid_model=hybrid,
        activation_func=F.silu,
    )
    values = dict(num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    result = outcome(lambda: configure_linear_cp_mode(config))
    is_auto = isinstance(mode, str) and mode == "auto"
    is_mode = isinstance(mode, str) and mode in MODES
    builds_gdn = variant == "gated_delta_net"
    if not (is_mode or is_auto):
        assert_refused_naming(result, "linear_cp_mode")
        return
    if not (builds_gdn or hybrid):  # no GDN layer: nothing about heads is looked at
        assert assert_accepted(result) == mode and config.linear_cp_mode == mode
        return
    problem = bad_size(values, config=True)
    if problem:
        assert_refused_naming(result, problem)
        return
    if is_auto:
        want = expected_auto(k, v, tp, cp)
        if want is None and builds_gdn:
            assert_refused_naming(result, "no mode is legal")
        elif want is None:  # hybrid: left to its GDN layers, if any
            assert assert_accepted(result) == "auto" and config.linear_cp_mode == "auto"
        else:
            assert assert_accepted(result) == want and config.linear_cp_mode == want
        return
    if builds_gdn and not legal(mode, k, v, tp, cp):
        assert_refused_naming(result, "linear_cp_mode")
    else:
        assert assert_accepted(result) == mode and config.linear_cp_mode == mode
