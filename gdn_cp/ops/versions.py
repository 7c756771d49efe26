"""The versions that decide a result (Python, torch, CUDA, Triton, FLA, megatron-core, gdn-cp, the
GPUs), read from package metadata without importing anything heavy: what ``gdn-cp selftest`` reports
and what every result row of the tests and benchmarks carries."""

from __future__ import annotations

import platform
from typing import Any, Optional

from .installed import dist_version
from .registry import BACKENDS

__all__ = ["stack_versions"]

def stack_versions(extra: Optional[dict] = None) -> dict[str, Any]:
    """Versions that decide a result: Python, torch (+ CUDA, threads), Triton, every backend's packages (its
    spec's ``versions``: FLA, FlashQLA and TileLang, ...), megatron-core, gdn-cp, the GPUs. Read from package
    metadata: nothing heavy is imported."""
    import torch

    import gdn_cp

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "triton": dist_version("triton"),
        **{key: version for spec in BACKENDS.values() for key, version in spec.versions().items()},
        "megatron_core": dist_version("megatron-core"),
        "gdn_cp": getattr(gdn_cp, "__version__", None),
        "gpu": None,
        "gpu_count": 0,
        "capability": None,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_count"] = torch.cuda.device_count()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    if extra:
        out.update(extra)
    return out
