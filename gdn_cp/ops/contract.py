"""What a per-rank math backend is, declared once: its facts (:class:`BackendSpec`) and its members
(:class:`Backend`).

A backend is one folder under ``gdn_cp/ops/`` and one line in :mod:`gdn_cp.ops.registry`. The folder's
``__init__.py`` hands on its ``SPEC`` (torch-free: the registry, the command line and the config check
read it; kept in ``spec.py`` where its kernel modules read it too) and defines ``load(settings)``,
which imports its kernel modules and returns its :class:`Backend` for the values of its ``GDN_CP_*``
settings (never a kernel library: those load on a kernel's first call).

Tensors are THD-packed rows without a batch dim. ``cu_seqlens`` are local boundaries of exactly the
rows given, as host ints: a :class:`~gdn_cp.layout.Boundaries` (modes pass the plan's, so a backend
finds its device copies cached on it) or a list / tuple of ints. A backend never reads device data
back to the host.

Callers use the members as declared here and never look one up by name: an optional member that a
backend does not offer holds its default, which says so (``None``, or a function answering None).
Adding an optional member is one field of :class:`Backend` with its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from .shape import GDNShape

__all__ = ["Backend", "BackendSpec", "NativeCPCore", "SelftestCase", "check_backend"]


def _runs_here() -> Optional[str]:
    return None


def _no_versions() -> dict:
    return {}


@dataclass(frozen=True)
class SelftestCase:
    """One check ``gdn-cp selftest`` runs on a backend against the reference in float64: ``kind`` (``conv``,
    ``gdn``: the selftest's case builders), the activations' ``dtype`` (a torch dtype's name) and, for ``gdn``,
    the head dims (``(Dk, Dv)``; None: the selftest's own)."""

    kind: str
    dtype: str
    head_dims: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class BackendSpec:
    """A backend's facts, torch-free.

    ``title``: how messages name it (``FLA``). ``devices``: the device
    types its kernels run on; ``devices_why`` says why in a refusal. ``preference``: the order in which
    ``auto`` tries the backends (lower first). ``problem``: why it cannot run in this Python (None when
    it can; probed once, never raises). ``tf32_dots``: fp32 inputs are multiplied with TF32 dot products
    (looser fp32 tolerances). ``dtypes``: the activation dtypes its kernels take (torch dtype names;
    None: any float). ``head_dims``: why its kernels cannot take head dims ``(Dk, Dv)`` (None: they can;
    the field None: any). ``narrow``: its kernels take so few layers that ``auto`` picks it only where
    the layer's head dims and dtype are known. ``native_cp``: what its native context-parallel cores
    need, for messages (None: it has none; chunkwise then always runs gdn-cp's own exchange on it).
    ``settings``: the ``GDN_CP_*`` variables its kernels take (:mod:`gdn_cp.env`'s table), read and
    checked with gdn-cp's other settings where a call comes in, and handed to its ``load``.
    ``first_use``: what a user waits for on its first call (a JIT compile), said before a run starts; "" for none.

    What the commands read (``gdn-cp doctor``, ``gdn-cp selftest``, the versions of a result row), so that they
    loop over the registry and name no backend: ``packages``: the distributions it is made of (doctor's version
    lines); ``versions``: their versions as result rows name them (:func:`gdn_cp.ops.versions.stack_versions`);
    ``tolerances``: the rel-L2 its kernels are held to against the fp64 reference, per activation dtype;
    ``selftest``: the :class:`SelftestCase` s the selftest runs on it (on a device it runs on, where it runs);
    ``verdict``: ``(label, line)``, doctor's one line on its installed stack (None: none); ``stack_report``:
    what it uses of its stack (``{"stack": ..., "choices": {...}}``; GPU machines only; None: nothing to say);
    ``selftest_notes``: notes for the selftest report from the versions of the stack (hazards).
    """

    name: str
    title: str
    devices: tuple[str, ...]
    devices_why: str
    preference: int
    problem: Callable[[], Optional[str]] = _runs_here
    tf32_dots: bool = False
    dtypes: Optional[tuple[str, ...]] = None
    head_dims: Optional[Callable[[int, int], Optional[str]]] = None
    narrow: bool = False
    native_cp: Optional[str] = None
    settings: tuple[str, ...] = ()
    first_use: Callable[[], str] = str
    packages: tuple[str, ...] = ()
    versions: Callable[[], dict] = _no_versions
    tolerances: Any = field(default=None, compare=False)  # {dtype name: rel-L2 against the fp64 reference}
    selftest: tuple[SelftestCase, ...] = ()
    verdict: Optional[Callable[[], tuple[str, str]]] = None
    stack_report: Optional[Callable[[], dict]] = None
    selftest_notes: Callable[[dict], list] = lambda versions: []

    def dtype_problem(self, dtype) -> Optional[str]:
        """Why its kernels cannot take activations of ``dtype`` (a torch dtype or its name; None: unknown)."""
        name = None if dtype is None else str(dtype).replace("torch.", "")
        if self.dtypes is None or name is None or name in self.dtypes:
            return None
        return f"{self.title} takes {' / '.join(self.dtypes)} activations only, not {name}"

    def layer_problem(self, head_dims: Optional[tuple[int, int]], dtype) -> Optional[str]:
        """Why its kernels cannot take a layer of ``head_dims`` ``(Dk, Dv)`` whose activations are
        ``dtype``; None when they can. Unknown values (None) pass, except for a ``narrow`` backend."""
        if self.narrow and (head_dims is None or None in head_dims or dtype is None):
            return f"{self.title}: chosen where the layer's head dims and dtype are known (its kernels take few)"
        if self.head_dims is not None and head_dims is not None and None not in head_dims:
            why = self.head_dims(*head_dims)
            if why is not None:
                return why
        return self.dtype_problem(dtype)

    def check_head_dims(self, head_k_dim: int, head_v_dim: int) -> None:
        """ValueError, with the fix, where its kernels cannot take these head dims."""
        why = None if self.head_dims is None else self.head_dims(head_k_dim, head_v_dim)
        if why is not None:
            raise ValueError(why)

    def check_dtype(self, dtype) -> None:
        """ValueError, with the fix, where its kernels cannot take activations of ``dtype``."""
        why = self.dtype_problem(dtype)
        if why is not None:
            raise ValueError(f"{why}. Fix: train in one of those (Megatron-LM --bf16), or linear_cp_backend='auto' "
                             "(the first backend that takes the layer)")


class NativeCPCore(Protocol):
    """A native context-parallel chunkwise core: conv (SiLU) + gated delta rule on this rank's
    contiguous slice, the halo and the carried state exchanged by the backend itself.

    ``qkv [T_local, C]`` pre-conv, ``g, beta [T_local, Hv]``, ``conv_weight [C, W]``;
    ``cu_seqlens_global``: the global boundaries; ``cache``: a dict that lives as long as the
    boundaries (a plan's ``backend_cache``) for the backend's context. Returns
    ``o [T_local, Hv, Dv]``. Everything is checked before the first collective.
    """

    def __call__(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: Optional[torch.Tensor],
        *,
        shape: GDNShape,
        cu_seqlens_global: Sequence[int],
        group,
        cache: Optional[dict] = None,
    ) -> torch.Tensor: ...


def _no_core(group) -> None:
    return None


def _nothing() -> None:
    return None


def _reads_grouped_heads() -> bool:
    return False


def _no_native_cp() -> str:
    return "it has no native context-parallel core"


def _any_rows(cu_seqlens_global: Sequence[int], cp_size: int, conv_kernel_size: int) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """A backend's members: what the modes, the Megatron glue and ``gdn-cp run`` call.

    Required (signatures as the reference backend's, ``gdn_cp.ops.reference``):

    - ``causal_conv1d(x [T, C], weight [C, W], bias [C] | None, *, cu_seqlens, halo [W-1, C] | None,
      activation "silu" | None) -> [T, C]``: depthwise causal conv restarting at every boundary;
      ``halo``: the rows before row 0 in row 0's sequence;
    - ``chunk_gated_delta_rule(q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], *, cu_seqlens, scale,
      initial_state [N, Hv, Dk, Dv] | None, output_final_state, use_qk_l2norm) -> (o [T, Hv, Dv],
      final_state [N, Hv, Dk, Dv] | None)``.

    Optional (the default says "not offered"):

    - ``native_cp_core(group) -> NativeCPCore | None``: its context-parallel core for ``group``, or
      None: chunkwise then exchanges halos and state summaries itself through ``gdn_cp.comm``;
    - ``native_zigzag_cp_core(group)``: the same on this rank's zigzag rows of the whole stream cut as
      one sequence (parts r and 2*cp-1-r), the documents' boundaries as ``cu_seqlens_global``;
      chunkwise then moves no rows (FLA >= 0.6);
    - ``native_cp_problem() -> str | None``: why its native cores cannot run in this process (None
      when they can, on a group they take); ``check_native_rows(cu_seqlens_global, cp, conv_width)``:
      ValueError where they cannot take this packing. ``gdn-cp run`` asks both before it spawns;
    - ``chunk_state_summary(k, v, g, beta, *, cu_seqlens, use_qk_l2norm) -> [N, Hv, Dk, Dk+Dv]`` or
      None: each sequence's affine state summary ``[M | S_ext]`` without a serial scan (the reference
      backend's); chunkwise's own exchange then starts the summary all-gather before scanning;
    - ``fused_gated_rms_norm() -> fn | None``: ``fn(x [N, D], z [N, D], weight [D], eps) -> x / rms(x)
      * weight * silu(z)`` in one kernel (FLA's); the Megatron glue uses it in place of the layer's
      ``out_norm`` then ``* act(z)`` where that is exactly what the layer computes;
    - ``repeats_key_heads() -> bool``: whether its ``chunk_gated_delta_rule`` repeats q and k to the value heads
      for its kernel (one without grouped value heads: FLA < 0.5); gdn-cp's glue may then hand them over repeated
      (``gdn_cp.ops.fused.glue.REPEAT_KEY_HEADS_IN_CONV``), which it takes as ``Hk = Hv``, the same values.
    """

    spec: BackendSpec
    causal_conv1d: Callable[..., Any]
    chunk_gated_delta_rule: Callable[..., Any]
    native_cp_core: Callable[[Any], Optional[NativeCPCore]] = _no_core
    native_zigzag_cp_core: Callable[[Any], Optional[NativeCPCore]] = _no_core
    native_cp_problem: Callable[[], Optional[str]] = _no_native_cp
    check_native_rows: Callable[[Sequence[int], int, int], None] = _any_rows
    chunk_state_summary: Optional[Callable[..., Any]] = None
    fused_gated_rms_norm: Callable[[], Optional[Callable]] = _nothing
    repeats_key_heads: Callable[[], bool] = _reads_grouped_heads

    @property
    def name(self) -> str:
        return self.spec.name

    def check_shape(self, shape: GDNShape, dtype) -> None:
        """ValueError, before any collective, where its kernels cannot take a layer of this
        :class:`~gdn_cp.ops.shape.GDNShape` whose activations are ``dtype`` (a torch dtype)."""
        self.spec.check_head_dims(shape.head_k_dim, shape.head_v_dim)
        self.spec.check_dtype(dtype)


def check_backend(backend, name: str = "backend") -> None:
    """TypeError unless ``backend`` is a :class:`Backend` (``gdn_cp.ops.get_backend(name)`` gives one)."""
    if not isinstance(backend, Backend):
        raise TypeError(
            f"{name} must be a gdn_cp.ops.Backend (gdn_cp.ops.get_backend('reference'), ('fla') or ('flashqla')), "
            f"got {type(backend).__name__} {backend!r:.60}"
        )
