"""Host->device copies of index tensors, made without a stream synchronization."""

from __future__ import annotations

import torch

__all__ = ["host_to_device"]


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a CPU tensor to ``device``. On CUDA a plain ``.to`` from pageable memory
    synchronizes the stream; staging through pinned memory with ``non_blocking`` does not."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
