"""Looks into a run that the library does not offer: which swap points chunkwise took, how many bytes
the all-to-alls sent, how many route and plan builds a micro-batch cost, which device->host syncs a call
made; and a setting of the environment for the length of a block.

Each is a context manager that wraps one library function (or one torch.distributed call) for the
length of the block, in this process, and gives it back afterwards, so the library keeps no
counters or hooks for tests: a rename breaks one function here (and its test), not every caller.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, TypeVar

__all__ = ["AllToAllBytes", "PlanBuilds", "all_to_all_bytes", "count_syncs", "env_setting", "first_sync_site",
           "plan_builds", "swap_points"]

T = TypeVar("T")


@contextlib.contextmanager
def env_setting(name: str, value: Optional[str]) -> Iterator[None]:
    """``os.environ[name] = value`` (None: unset) for the block, then as it was (e.g.
    ``GDN_CP_CHUNKWISE_SWAP=core`` for the layers a block runs: the settings read it on every call)."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def swap_points() -> Iterator[dict]:
    """``{layer label: {swap point, ...}}`` that chunkwise chose for the layer calls of the block
    (``"hidden"`` / ``"core"``; a call through the zigzag core moves nothing and adds none)."""
    from gdn_cp.modes.chunkwise import Chunkwise

    seen: dict = {}
    original = Chunkwise.__dict__["prepare"]

    def recording(cls, ctx):
        mode = original.__func__(cls, ctx)
        if mode.swap is not None:
            seen.setdefault(ctx.layer.label, set()).add(mode.swap)
        return mode

    Chunkwise.prepare = classmethod(recording)
    try:
        yield seen
    finally:
        Chunkwise.prepare = original


@dataclass
class AllToAllBytes:
    """Bytes this rank handed to ``all_to_all_single`` (every route and seq<->head all-to-all) and calls."""

    bytes: int = 0
    calls: int = 0


@contextlib.contextmanager
def all_to_all_bytes() -> Iterator[AllToAllBytes]:
    """Count what this rank sends through ``torch.distributed.all_to_all_single`` in the block (host
    sizes only: no device work)."""
    import torch.distributed as dist

    count = AllToAllBytes()
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        count.bytes += input.numel() * input.element_size()
        count.calls += 1
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        yield count
    finally:
        dist.all_to_all_single = original


@dataclass
class PlanBuilds:
    """Routes, natural-order maps and chunkwise plans built (by any plan) in the block."""

    counts: dict = field(default_factory=lambda: {"route": 0, "natural_order": 0, "chunkwise": 0})

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def plan_builds() -> Iterator[PlanBuilds]:
    """Count the builds a :class:`gdn_cp.layout.plan.CPPlan` makes in the block (a plan reused by
    every layer, both directions and recompute builds each of its pieces once)."""
    from gdn_cp.layout import plan as plan_module

    builds = PlanBuilds()
    names = {"route": "build_thd_route", "natural_order": "build_natural_order", "chunkwise": "build_chunkwise_plan"}
    originals = {key: getattr(plan_module, name) for key, name in names.items()}

    def counting(key):
        def build(*args, **kwargs):
            builds.counts[key] += 1
            return originals[key](*args, **kwargs)

        return build

    for key, name in names.items():
        setattr(plan_module, name, counting(key))
    try:
        yield builds
    finally:
        for key, name in names.items():
            setattr(plan_module, name, originals[key])


def _site(frames, depth: int = 3) -> str:
    """The innermost ``depth`` frames of ``frames`` outside torch, ``warnings`` and this module, innermost first:
    ``"flash_qla/utils/index.py:116 _fallback_prepare_chunk_offsets <- ..."``."""
    import torch

    skip = (os.path.dirname(torch.__file__) + os.sep, warnings.__file__, __file__)
    kept = [f for f in frames if not f.filename.startswith(skip)]
    return " <- ".join(f"{'/'.join(f.filename.split(os.sep)[-3:])}:{f.lineno} {f.name}"
                       for f in reversed(kept[-depth:])) or "?"


def count_syncs(fn: Callable[[], T]) -> tuple[T, list[str]]:
    """``(fn(), messages)``: the device->host syncs ``fn`` makes, as torch's sync debug mode "warn" reports them,
    after a device synchronize (torch's one-time notice that the mode is a prototype feature is not a sync), each
    with the Python frames that made it (``"... at file:line function <- caller"``; a sync in a backward that
    autograd ran on its own thread is reported at the ``backward()`` call: :func:`first_sync_site` finds it). The
    GPU tests and ``benchmarks/syncs.py`` count them this one way."""
    import torch

    torch.cuda.synchronize()
    found: list[str] = []

    def note(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" in text.lower() and "prototype feature" not in text and "debug mode" not in text:
            found.append(f"{text} at {_site(traceback.extract_stack())}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return result, found


def first_sync_site(fn: Callable[[], object]) -> Optional[str]:
    """Where ``fn``'s first device->host sync is, backward included: ``fn`` run under torch's sync debug mode
    "error", the frames of the error it raises (None: it made none). For a failure message: ``fn`` stops there."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        return _site(traceback.extract_tb(err.__traceback__), depth=5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return None
