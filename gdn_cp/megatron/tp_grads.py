"""The TP gradient of GatedDeltaNet's ``out_norm``: summed over the TP group, once, exactly.

``out_norm`` (RMSNorm over the value head dim D_v) is replicated over TP, but each TP rank
applies it to its own value heads only, so the gradient autograd gives rank r is the part of
its heads. Megatron-core 0.19.2's ``finalize_model_grads`` sums such a parameter over TP only
when ``config.sequence_parallel`` is on and the parameter is tagged ``sequence_parallel`` (as
TransformerEngine's norms tag theirs); without sequence parallelism it sums nothing, so the TP
replicas of ``out_norm.weight`` get different gradients and drift apart from the first step.

Fix: a gradient hook on each such parameter that sums its gradient over the layer's TP group
before autograd accumulates it (so Megatron's DDP sees the full gradient in ``main_grad``).
It is registered once per parameter, from :func:`install_tp_grad_sum`, which the patched
forward calls on each layer's first call (stock CP=1 SBHD path included), and only where finalize
will not sum the parameter itself (no double reduction under sequence parallelism). Cost: one all-reduce
of D_v (+ D_v for a LayerNorm bias) values per layer per backward, on TP > 1 only.
"""

from __future__ import annotations

import logging

from ..comm import sum_over_group

__all__ = ["TP_GRAD_SUM_ATTR", "install_tp_grad_sum"]

logger = logging.getLogger(__name__)

TP_GRAD_SUM_ATTR = "_gdn_cp_tp_grad_sum"  # set on a parameter whose gradient hook is installed


def install_tp_grad_sum(layer) -> list[str]:
    """Install the TP gradient sum on ``layer``'s partial-gradient parameters; idempotent.

    ``layer`` is the release adapter of a GatedDeltaNet (:func:`gdn_cp.megatron.gdn.layer_state`'s ``adapter``).
    Returns the names of the parameters hooked now (empty on later calls, at TP = 1, and where
    finalize_model_grads sums the parameter itself). Registers hooks only: no collective here.
    """
    if layer.tp_size == 1:
        return []
    group = layer.tp_group
    hooked = []
    for name, param in layer.tp_partial_grad_params():
        if getattr(param, TP_GRAD_SUM_ATTR, False) or not param.requires_grad:
            continue
        if layer.finalize_sums_over_tp(param):
            continue
        param.register_hook(lambda grad, g=group: sum_over_group(grad, g))
        setattr(param, TP_GRAD_SUM_ATTR, True)
        hooked.append(name)
    if hooked:
        logger.info(
            "GatedDeltaNet layer %s: gradients of %s are summed over the TP group (%d ranks): they are "
            "replicated over TP but each rank computes only its heads' part, and finalize_model_grads "
            "sums them only under sequence parallelism", layer.layer_number, ", ".join(hooked), layer.tp_size,
        )
    return hooked
