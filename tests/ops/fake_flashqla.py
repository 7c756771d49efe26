"""A CPU stand-in for FlashQLA 0.1.3, for the FlashQLA backend's plumbing tests (tests only).

``flash_qla.chunk_gated_delta_rule`` here takes FlashQLA's arguments and refuses what FlashQLA
refuses or mishandles (head dims other than 128, dtypes other than bf16 / fp16, q/k/v of different
dtypes, a batch > 1 with ``cu_seqlens``, boundaries that are not an int32 tensor on q's device, an
empty sequence, a state count other than the sequence count, value heads not a multiple of key
heads, an odd number of value heads: TileLang's layout failure on an H200), then computes with gdn-cp's
reference kernels (fp32 math) on the unbatched rows, value
head h reading key head h // (HV / H) as FlashQLA's GVA does. Every call is recorded in
:data:`CALLS`. :func:`install` puts the fake package into ``sys.modules`` and makes the backend
take CPU tensors; :func:`uninstall` undoes both. ``install(record_only=True)``: the calls are checked and
recorded, their outputs zeros (of the right shapes, connected to every input for autograd), for a test that
needs only which calls a run makes.
"""

from __future__ import annotations

import sys
import types

import torch

CALLS: list[dict] = []
_SAVED: dict = {}
_RECORD_ONLY = [False]
_NAMES = ("flash_qla", "flash_qla.ops", "flash_qla.ops.gated_delta_rule", "flash_qla.ops.gated_delta_rule.chunk")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False, state_v_first=False,
                           auto_cp=True, enable_fwd_cp_cache=True, cp_context=None, force_intra_cp=False):
    from gdn_cp.ops import get_backend

    reference = get_backend("reference")

    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.dtype in (torch.bfloat16, torch.float16), "FlashQLA only supports bfloat16 and float16."
    assert q.shape[-1] == 128 and v.shape[-1] == 128, "K == V == 128"
    assert v.shape[2] % k.shape[2] == 0
    # FlashQLA 0.1.3 on an H200: TileLang finds no layout for chunk_local_cumsum's [HV, 64] fragment when HV is odd
    assert v.shape[2] % 2 == 0, "tvm InternalError: Check failed: (has_best) is false: no available layout found"
    assert cp_context is None, "the CPU stand-in has no inter-card context"
    assert q.shape[0] == 1 and cu_seqlens is not None, "gdn-cp always passes B == 1 and cu_seqlens"
    assert isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device
    cu = [int(x) for x in cu_seqlens.tolist()]
    assert cu[0] == 0 and cu[-1] == q.shape[1] and all(b > a for a, b in zip(cu, cu[1:])), f"bad cu_seqlens {cu}"
    if initial_state is not None:
        assert initial_state.shape[0] == len(cu) - 1 and initial_state.dtype == torch.float32
    assert g.dtype == torch.float32 and g.shape == v.shape[:3] and beta.shape == v.shape[:3]
    CALLS.append({"T": q.shape[1], "H": k.shape[2], "HV": v.shape[2], "K": k.shape[-1], "V": v.shape[-1],
                  "cu": cu, "dtype": q.dtype, "beta_dtype": beta.dtype, "h0": initial_state is not None,
                  "final": output_final_state, "l2norm": use_qk_l2norm_in_kernel, "auto_cp": auto_cp,
                  "scale": scale})
    if _RECORD_ONLY[0]:
        touched = sum(t.float().sum() for t in (q, k, g, beta, initial_state) if t is not None) * 0.0
        fs = (torch.zeros(len(cu) - 1, v.shape[2], k.shape[-1], v.shape[-1]) + touched) if output_final_state else None
        return v * 0 + touched.to(v.dtype), fs
    o, fs = reference.chunk_gated_delta_rule(
        q[0], k[0], v[0], g[0], beta[0], cu_seqlens=cu, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel)
    return o.unsqueeze(0).to(q.dtype), fs


def build_cp_context(cu_seqlens=None, *, enable_inter=False, enable_intra=False, group=None, num_v_heads=None,
                     chunk_size=None, conv1d_kernel_size=None, cu_seqlens_cpu=None, g=None, is_train=False,
                     force_intra_cp=False):
    raise AssertionError("the CPU stand-in has no inter-card context")


def _package() -> dict:
    top = types.ModuleType("flash_qla")
    top.__version__ = "0.1.3"
    top.chunk_gated_delta_rule = chunk_gated_delta_rule
    ops = types.ModuleType("flash_qla.ops")
    gdr = types.ModuleType("flash_qla.ops.gated_delta_rule")
    chunk = types.ModuleType("flash_qla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule = chunk_gated_delta_rule
    chunk.build_cp_context = build_cp_context
    chunk.CHUNK_SIZE = 64
    top.ops, ops.gated_delta_rule, gdr.chunk = ops, gdr, chunk
    return dict(zip(_NAMES, (top, ops, gdr, chunk)))


def install(record_only: bool = False) -> None:
    """The fake into ``sys.modules``; the backend probed as usable (sm_90) and taking CPU tensors."""
    _RECORD_ONLY[0] = record_only
    from gdn_cp.ops.flashqla import detect, kernels

    for name, module in _package().items():
        _SAVED.setdefault(name, sys.modules.get(name))
        sys.modules[name] = module
    _SAVED.setdefault("devices", kernels.DEVICE_TYPES)
    kernels.DEVICE_TYPES = ("cuda", "cpu")
    detect.features.cache_clear()
    _SAVED.setdefault("probe", detect.probe)
    fake = detect.FlashQLAFeatures(None, (9, 0), inter_card_cp=True, chunk_size=64)
    detect.probe = lambda *a, **k: fake
    kernels.flashqla_api.cache_clear()
    CALLS.clear()


def uninstall() -> None:
    from gdn_cp.ops.flashqla import detect, kernels

    for name in _NAMES:
        old = _SAVED.pop(name, None)
        if old is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old
    if "devices" in _SAVED:
        kernels.DEVICE_TYPES = _SAVED.pop("devices")
    if "probe" in _SAVED:
        detect.probe = _SAVED.pop("probe")
    detect.features.cache_clear()
    kernels.flashqla_api.cache_clear()
    CALLS.clear()
    _RECORD_ONLY[0] = False
