"""``torch.compile`` that compiles on the first call instead of when it is applied, for CPU test ranks.

megatron-core applies ``torch.compile`` (its ``jit_fuser``) to a dozen functions while it is imported, and
applying it imports TorchInductor: ~1.5 of the ~4.5 CPU seconds a process spends importing megatron-core
(measured on the 2-core CI machine; docs/testing.md, "Time and threads"). In the test ranks those functions
then run with dynamo switched off (``gdn_cp_testing.megatron.layer.install_cpu_shims``), i.e. as plain Python,
so the import bought nothing. :func:`install` makes ``torch.compile(fn)`` return a wrapper that, when called,
runs ``fn`` as it is where dynamo is off (what the compiled function would do) and otherwise compiles ``fn``
with the real ``torch.compile`` once and runs that: the same results, the compile's cost moved to where it
is used. Modules and anything not a plain callable go to the real ``torch.compile`` at once."""

from __future__ import annotations

import functools
import sys

import torch

_REAL = torch.compile


def _lazy_compile(model=None, **kwargs):
    if model is None:  # used as @torch.compile(mode=...)
        return lambda fn: _lazy_compile(fn, **kwargs)
    if isinstance(model, torch.nn.Module) or not callable(model):
        return _REAL(model, **kwargs)
    compiled = None

    @functools.wraps(model)
    def run(*args, **kw):
        nonlocal compiled
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and dynamo.config.disable:
            return model(*args, **kw)
        if compiled is None:
            compiled = _REAL(model, **kwargs)
        return compiled(*args, **kw)

    return run


def install() -> None:
    """Idempotent: ``torch.compile`` is :func:`_lazy_compile` in this process from now on."""
    torch.compile = _lazy_compile


def installed() -> bool:
    return torch.compile is _lazy_compile
