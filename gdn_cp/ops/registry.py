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

__all__ = [
    "AUTO", "BACKEND_CHOICES", "BackendSpec", "BACKENDS", "BACKEND_NAMES", "ORACLE", "backend_problem", "backend_spec",
    "choose_backend_name", "get_backend", "resolve_backend", "unknown_backend_error",
]


@dataclass(frozen=True)
class BackendSpec:
    """One backend.

    ``title``: how messages name it (``FLA``). ``module``: imports the backend on first use (a plain import statement, which readers and
    tools follow; it may import torch, never a kernel library: those load on first call).
    ``devices``: the device types its kernels run on, and ``devices_why`` says why in a refusal.
    ``problem``: why it cannot run in this Python (None when it can; probed once, never raises).
    ``tf32_dots``: fp32 inputs are multiplied with TF32 dot products (looser fp32 tolerances).
    ``preference``: order in which ``auto`` chooses among the backends that run on a device and take
    the layer (lower first). ``native_cp``: what its native context-parallel cores need, for messages
    (None: it has none; then chunkwise always runs gdn-cp's own exchange on it).
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
    takes: Optional[Callable[[Optional[int], Optional[int], Optional[str]], Optional[str]]] = None
    """``takes(head_k_dim, head_v_dim, dtype name)``: why its kernels cannot take a layer of these head
    dims whose activations are of that dtype (None when they can; any argument may be None, unknown).
    None: it takes anything."""


def _reference() -> ModuleType:
    from . import reference

    return reference


def _fla() -> ModuleType:
    from . import fla

    return fla


def _fla_problem() -> Optional[str]:
    from .fla.detect import fla_import_error  # FLA-free until asked; then probed once per process

    return fla_import_error()


def _fla_takes(head_k_dim: Optional[int], head_v_dim: Optional[int], dtype: Optional[str]) -> Optional[str]:
    if head_k_dim is None or head_v_dim is None:
        return None  # FLA's range is wide: checked again by its kernels (check_core) before any collective
    from .fla.kernels import check_head_dims  # torch, not FLA

    try:
        check_head_dims(head_k_dim, head_v_dim)
    except ValueError as err:
        return str(err)
    return None


def _flashqla() -> ModuleType:
    from . import flashqla

    return flashqla


def _flashqla_problem() -> Optional[str]:
    from .flashqla.detect import flashqla_problem  # FlashQLA-free until asked; then probed once per process

    return flashqla_problem()


def _flashqla_takes(head_k_dim: Optional[int], head_v_dim: Optional[int], dtype: Optional[str]) -> Optional[str]:
    if head_k_dim is None or head_v_dim is None or dtype is None:
        return "FlashQLA takes head dims 128 and bf16 / fp16 only: chosen where the layer's head dims and dtype are known"
    if dtype not in ("bfloat16", "float16"):
        return f"FlashQLA takes bfloat16 / float16 activations only, not {dtype}"
    from .flashqla.kernels import check_head_dims  # torch, not FlashQLA

    try:
        check_head_dims(head_k_dim, head_v_dim)
    except ValueError as err:
        return str(err)
    return None


ORACLE = "reference"
"""The plain-torch backend: any device, any float dtype; what ``deterministic_mode`` and the CPU use,
and what the others are checked against."""

BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            name="reference", title="the reference backend", module=_reference, devices=("cpu", "cuda"), devices_why="plain torch",
            problem=lambda: None, tf32_dots=False, preference=2,
        ),
        BackendSpec(
            name="fla", title="FLA", module=_fla, devices=("cuda",), devices_why="FLA's kernels are CUDA-only",
            problem=_fla_problem, tf32_dots=True, preference=1,
            native_cp="a CUDA GPU with flash-linear-attention >= 0.4.2", takes=_fla_takes,
        ),
        BackendSpec(
            name="flashqla", title="FlashQLA", module=_flashqla, devices=("cuda",),
            devices_why="FlashQLA's TileLang kernels run on NVIDIA sm_90+ GPUs only",
            problem=_flashqla_problem, tf32_dots=False, preference=0,
            native_cp="an sm_90+ GPU with flash-qla >= 0.1.3 and FLA's cp context (the conv)", takes=_flashqla_takes,
        ),
    )
}

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


def get_backend(name: str):
    """The backend called ``name`` (its module, imported on first use; a :class:`Backend`)."""
    return backend_spec(name).module()


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
    problem = spec.problem()
    if problem is not None:
        return problem
    if spec.takes is None:
        return None
    dk, dv = head_dims if head_dims is not None else (None, None)
    return spec.takes(dk, dv, dtype)


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
