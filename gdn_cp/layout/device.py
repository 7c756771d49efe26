"""Host->device copies of index tensors, made without a stream synchronization, and the tensor test
of the index math (which imports no torch: ``gdn-cp route`` answers integer questions without it)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["host_to_device", "is_tensor"]


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch: a process that has not imported
    torch holds no tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def host_to_device(t: "torch.Tensor", device) -> "torch.Tensor":
    """Copy a CPU tensor to ``device``. On CUDA a plain ``.to`` from pageable memory
    synchronizes the stream; staging through pinned memory with ``non_blocking`` does not."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
