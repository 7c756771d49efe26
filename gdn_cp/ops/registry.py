"""The backend registry: one entry per per-rank math backend, with everything gdn-cp needs to know of
a backend outside its own files.

Torch-free (the command line builds its ``--backend`` flag from it). A new backend is one module
or package under ``gdn_cp/ops/`` satisfying :class:`~gdn_cp.ops.contract.Backend` (with the
optional members it has) plus one :class:`BackendSpec` entry below; the Megatron glue, ``gdn-cp
run``, the tolerances and the tests read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

__all__ = ["BackendSpec", "BACKENDS", "BACKEND_NAMES", "ORACLE", "backend_spec", "choose_backend_name", "get_backend"]


@dataclass(frozen=True)
class BackendSpec:
    """One backend.

    ``title``: how messages name it (``FLA``). ``module``: imports the backend on first use (a plain import statement, which readers and
    tools follow; it may import torch, never a kernel library: those load on first call).
    ``devices``: the device types its kernels run on, and ``devices_why`` says why in a refusal.
    ``problem``: why it cannot run in this Python (None when it can; probed once, never raises).
    ``tf32_dots``: fp32 inputs are multiplied with TF32 dot products (looser fp32 tolerances).
    ``preference``: order in which gdn-cp chooses among the backends that run on a device (lower
    first). ``native_cp``: what its native context-parallel cores need, for messages (None: it has
    none; then chunkwise always runs gdn-cp's own exchange on it).
    """

    name: str
    title: str
    module: Callable[[], ModuleType]
    devices: tuple[str, ...]
    devices_why: str
    problem: Callable[[], Optional[str]]
    tf32_dots: bool
    preference: int
    native_cp: Optional[str] = None


def _reference() -> ModuleType:
    from . import reference

    return reference


def _fla() -> ModuleType:
    from . import fla

    return fla


def _fla_problem() -> Optional[str]:
    from .fla.detect import fla_import_error  # FLA-free until asked; then probed once per process

    return fla_import_error()


ORACLE = "reference"
"""The plain-torch backend: any device, any float dtype; what ``deterministic_mode`` and the CPU use,
and what the others are checked against."""

BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            name="reference", title="the reference backend", module=_reference, devices=("cpu", "cuda"), devices_why="plain torch",
            problem=lambda: None, tf32_dots=False, preference=1,
        ),
        BackendSpec(
            name="fla", title="FLA", module=_fla, devices=("cuda",), devices_why="FLA's kernels are CUDA-only",
            problem=_fla_problem, tf32_dots=True, preference=0,
            native_cp="a CUDA GPU with flash-linear-attention >= 0.4.2",
        ),
    )
}

BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend_spec(name) -> BackendSpec:
    """The entry of ``name``; ValueError naming the registered backends otherwise."""
    spec = BACKENDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return spec


def get_backend(name: str):
    """The backend called ``name`` (its module, imported on first use; a :class:`Backend`)."""
    return backend_spec(name).module()


def choose_backend_name(device_type: str, *, deterministic: bool = False) -> str:
    """The backend gdn-cp runs on ``device_type`` when none is named: the :data:`ORACLE` under
    ``deterministic``, else the most preferred one that runs there and imports here."""
    if deterministic:
        return ORACLE
    for spec in sorted(BACKENDS.values(), key=lambda s: s.preference):
        if device_type in spec.devices and spec.problem() is None:
            return spec.name
    return ORACLE
