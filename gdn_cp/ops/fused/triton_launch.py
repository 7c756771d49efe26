"""How gdn-cp's Triton glue kernels are launched: autotuned on a GPU (as FLA tunes its kernels), one fixed config
under Triton's interpreter (the CPU tests: ``TRITON_INTERPRET=1`` before Triton is imported)."""

from __future__ import annotations

import inspect
import os

import triton

__all__ = ["INTERPRETED", "TILE_CONFIGS", "launcher", "tuned_configs"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TILE_CONFIGS = [({"BT": bt}, w) for bt in (16, 32, 64) for w in (4, 8)]
"""The row-tile kernels' autotuning configs, ``(meta, num_warps)``: tiles of 16, 32 or 64 rows, 4 or 8 warps."""


_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
"""Autotune results kept in Triton's cache, as FLA keeps its own (``FLA_CACHE_RESULTS``): a later process with the
same kernel, key and GPU target reads the choice instead of timing every config again (a few KiB per kernel)."""

_TUNED: dict = {}
"""The autotuned launcher of each kernel, by its name (:func:`launcher`), for :func:`tuned_configs`."""


def launcher(kernel, key: list, configs: list, fixed: dict):
    """``launch(grid(meta), *args, **kwargs)``: ``kernel`` autotuned over ``configs`` (``(meta, num_warps)``, keyed
    on ``key``) on a GPU; with the ``fixed`` config (``meta`` and ``num_warps``) under Triton's interpreter."""
    if INTERPRETED:
        def launch(grid, *args, **kwargs):
            meta = dict(fixed)
            warps = meta.pop("num_warps")
            kernel[grid(meta)](*args, **kwargs, **meta, num_warps=warps)
        return launch
    tuned = triton.autotune(configs=[triton.Config(m, num_warps=w) for m, w in configs], key=key,
                            **_CACHE_RESULTS)(kernel)
    _TUNED[kernel.__name__] = tuned

    def launch(grid, *args, **kwargs):
        tuned[grid](*args, **kwargs)
    return launch


def tuned_configs() -> dict:
    """``{kernel: {key: "meta, num_warps"}}``: the config autotuning chose for each key so far in this process
    (``benchmarks/glue_kernels.py`` records them beside its timings; empty under the interpreter)."""
    return {name: {str(key): f"{config.kwargs}, num_warps {config.num_warps}" for key, config in tuned.cache.items()}
            for name, tuned in _TUNED.items() if tuned.cache}
