"""Point-to-point transfers of CUDA tensors staged through the host, for ranks that share one GPU over gloo
(test-only: :func:`gdn_cp_testing.megatron.lm.install_rank_shims` installs it in such a rank).

gloo cannot send or receive CUDA tensors point to point (../shared/DESIGN.md), and Megatron needs it for:
pipeline parallelism (``megatron.core.pipeline_parallel.p2p_communication``: activations and gradients
between stages through ``torch.distributed.batch_isend_irecv`` or ``isend`` / ``irecv``, and with
``variable_seq_lengths`` their shapes first) and multi-token prediction under CP
(``multi_token_prediction.roll_tensor``: boundary tokens between neighbouring CP ranks through ``isend`` /
``irecv``). :func:`install` replaces ``torch.distributed``'s ``isend``, ``irecv``, ``send`` and ``recv``
(both in ``torch.distributed`` and in ``distributed_c10d``, whose ``batch_isend_irecv`` and ``P2POp`` look
them up there) with versions that move a CUDA tensor through a host copy:

* a send copies the tensor to the host (which waits for the kernels that produce it) and sends the copy,
  kept alive until the request is waited on;
* a receive receives into a host buffer of the tensor's shape and dtype and copies it into the CUDA tensor
  when the request is waited on (Megatron and torch wait on every receive before reading it), outside
  autograd (Megatron's pipeline receives activations into leaf tensors that require grad).

Host tensors pass through unchanged, so CPU ranks run the original functions; ``stage_all=True`` stages them
too, which is how the CPU tests drive this path. Same matching as the originals (peer, group, tag, order).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["install", "installed"]

_NAMES = ("isend", "irecv", "send", "recv")
_ORIGINAL: dict[str, Callable] = {}
_STATE = {"stage_all": False}


def installed() -> bool:
    return bool(_ORIGINAL)


def _staged(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" or _STATE["stage_all"]


class _Request:
    """A request of the original call, with the host copy it transfers; a receive's ``wait`` copies the
    received host buffer into the caller's tensor (once)."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor | None = None):
        self._work, self._host, self._target = work, host, target

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs) if self._work is not None else True
        if self._target is not None:
            with torch.no_grad():  # Megatron receives activations into leaf tensors that require grad
                self._target.copy_(self._host)
            self._target = None
        return result

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def __getattr__(self, name):  # anything else a Work offers
        return getattr(self._work, name)


def _isend(tensor, *args, **kwargs):
    if not _staged(tensor):
        return _ORIGINAL["isend"](tensor, *args, **kwargs)
    host = tensor.detach().to("cpu", copy=True)
    return _Request(_ORIGINAL["isend"](host, *args, **kwargs), host)


def _irecv(tensor, *args, **kwargs):
    if not _staged(tensor):
        return _ORIGINAL["irecv"](tensor, *args, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return _Request(_ORIGINAL["irecv"](host, *args, **kwargs), host, tensor)


def _send(tensor, *args, **kwargs):
    if not _staged(tensor):
        return _ORIGINAL["send"](tensor, *args, **kwargs)
    return _ORIGINAL["send"](tensor.detach().to("cpu", copy=True), *args, **kwargs)


def _recv(tensor, *args, **kwargs):
    if not _staged(tensor):
        return _ORIGINAL["recv"](tensor, *args, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    source = _ORIGINAL["recv"](host, *args, **kwargs)
    with torch.no_grad():
        tensor.copy_(host)
    return source


_REPLACEMENTS = {"isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv}


def install(*, stage_all: bool = False) -> Callable[[], None]:
    """Replace the point-to-point functions (module docstring); idempotent. Returns a function that puts the
    originals back."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _STATE["stage_all"] = stage_all
    if not _ORIGINAL:
        for name in _NAMES:
            _ORIGINAL[name] = getattr(c10d, name)
            replacement = functools.wraps(_ORIGINAL[name])(_REPLACEMENTS[name])
            setattr(c10d, name, replacement)
            setattr(dist, name, replacement)

    def uninstall() -> None:
        for name, original in _ORIGINAL.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        _ORIGINAL.clear()
        _STATE["stage_all"] = False

    return uninstall
