"""The backend registry: one line per per-rank math backend.

Torch-free (the command line builds its ``--backend`` flag from it). A backend is one folder under
``gdn_cp/ops/`` (its ``SPEC`` and ``load(settings)``: :mod:`gdn_cp.ops.contract`) and its line in
:data:`PACKAGES`; the Megatron glue, ``gdn-cp run``, the tolerances and the tests read it from here.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Mapping, Optional

from .. import env
from . import fla, flashqla, reference
from .contract import Backend, BackendSpec

__all__ = [
    "AUTO", "BACKEND_CHOICES", "BackendSpec", "BACKENDS", "BACKEND_NAMES", "ORACLE", "backend_problem",
    "backend_settings", "backend_spec", "choose_backend_name", "get_backend", "resolve_backend", "unknown_backend_error",
]

PACKAGES: dict[str, ModuleType] = {package.SPEC.name: package for package in (
    reference,
    fla,
    flashqla,
)}
"""Each backend's package (its ``SPEC`` and ``load(settings)``), by name."""

BACKENDS: dict[str, BackendSpec] = {name: package.SPEC for name, package in PACKAGES.items()}

ORACLE = "reference"
"""The plain-torch backend: any device, any float dtype; what ``deterministic_mode`` and the CPU use,
and what the others are checked against."""

BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)

AUTO = "auto"
BACKEND_CHOICES: tuple[str, ...] = (AUTO, *BACKEND_NAMES)
"""What a user may ask for (``TransformerConfig.linear_cp_backend``, ``--linear-cp-backend``): ``auto``
or a backend's name."""
AUTO_ORDER = ", ".join(s.name for s in sorted(BACKENDS.values(), key=lambda s: s.preference))


def backend_spec(name) -> BackendSpec:
    """The entry of ``name``; ValueError naming the registered backends otherwise."""
    spec = BACKENDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return spec


def backend_settings(environ: Optional[Mapping[str, str]] = None) -> tuple[tuple[str, Any], ...]:
    """Every backend's ``GDN_CP_*`` settings (their specs' ``settings``) as ``(variable, value)`` pairs,
    read and checked now (a bad value: ValueError naming the variable)."""
    return tuple((var, env.read(var, environ)) for spec in BACKENDS.values() for var in spec.settings)


@functools.lru_cache(maxsize=None)  # a name and settings' values: one Backend each per process
def _load(name: str, settings: tuple[tuple[str, Any], ...]) -> Backend:
    return PACKAGES[name].load(dict(settings))


def get_backend(name: str, settings: Optional[tuple[tuple[str, Any], ...]] = None) -> Backend:
    """The backend called ``name`` for these values of its settings (:func:`backend_settings`, e.g. a
    call's ``Settings.backend_settings``; None: read from the environment now). Its kernel modules are
    imported on first use."""
    spec = backend_spec(name)
    values = dict(backend_settings() if settings is None else settings)
    return _load(spec.name, tuple((var, values[var] if var in values else env.read(var, {})) for var in spec.settings))


def unknown_backend_error(requested, where: str = "") -> ValueError:
    """The error for a ``linear_cp_backend`` that is neither ``auto`` nor a backend (``where``: the
    field's owner, e.g. ``"TransformerConfig."``)."""
    return ValueError(f"{where}linear_cp_backend={requested!r} is not a backend; set it to one of "
                      f"{', '.join(repr(c) for c in BACKEND_CHOICES)} (Megatron-LM: --linear-cp-backend "
                      f"{{{','.join(BACKEND_CHOICES)}}}).")


def backend_problem(name: str, device_type: str, *, head_dims: Optional[tuple[int, int]] = None,
                    dtype: Optional[str] = None) -> Optional[str]:
    """Why backend ``name`` cannot run a layer of ``head_dims`` (``(Dk, Dv)``) with activations of
    ``dtype`` (a torch dtype's name, e.g. ``"bfloat16"``) on ``device_type`` in this process; None when
    it can (unknown head dims or dtype: as far as the rest says)."""
    spec = backend_spec(name)
    if device_type not in spec.devices:
        return f"{spec.title} runs on {' or '.join(spec.devices)} only ({spec.devices_why}), not {device_type}"
    return spec.problem() or spec.layer_problem(head_dims, dtype)


def resolve_backend(requested: str, device_type: str, *, deterministic: bool = False,
                    head_dims: Optional[tuple[int, int]] = None, dtype: Optional[str] = None) -> tuple[str, str]:
    """``(backend name, why)`` for ``requested`` (a name of :data:`BACKEND_CHOICES`).

    ``auto``: the :data:`ORACLE` under ``deterministic``, else the most preferred backend
    (``preference``: FlashQLA, FLA, reference) that runs on ``device_type``, imports here and takes
    the layer (:func:`backend_problem`); the reasons for skipping the others are in ``why``. A
    named backend is returned as it is when it can run, else ValueError saying why (also under
    ``deterministic``, which only the oracle honours). A pure function of what is installed and its
    arguments: the same answer on every call."""
    if requested == AUTO:
        if deterministic:
            return ORACLE, "deterministic_mode: the plain-torch reference kernels"
        skipped = []
        for spec in sorted(BACKENDS.values(), key=lambda s: s.preference):
            why = backend_problem(spec.name, device_type, head_dims=head_dims, dtype=dtype)
            if why is None:
                return spec.name, "; ".join([*skipped, f"{spec.name}: the first of {AUTO_ORDER} that runs and takes the layer"])
            skipped.append(f"{spec.name}: {why}")
        raise ValueError(f"no backend runs on {device_type}: " + "; ".join(skipped))  # the oracle runs anywhere
    spec = backend_spec(requested)
    if deterministic and requested != ORACLE:
        raise ValueError(f"backend {requested!r} with deterministic_mode: deterministic_mode runs the plain-torch "
                         f"{ORACLE!r} backend only")
    why = backend_problem(requested, device_type, head_dims=head_dims, dtype=dtype)
    if why is not None:
        raise ValueError(f"backend {requested!r} cannot run here: {why}")
    return requested, "requested"


def choose_backend_name(device_type: str, *, deterministic: bool = False, head_dims: Optional[tuple[int, int]] = None,
                        dtype: Optional[str] = None) -> str:
    """The backend ``auto`` resolves to (:func:`resolve_backend`): the :data:`ORACLE` under
    ``deterministic``, else the most preferred one that runs there, imports here and takes the layer
    (FlashQLA only where the head dims and dtype are given and it takes them)."""
    return resolve_backend(AUTO, device_type, deterministic=deterministic, head_dims=head_dims, dtype=dtype)[0]
