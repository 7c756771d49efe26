"""What a per-rank math backend provides: the contract the modes call.

Tensors are THD-packed rows without a batch dim. ``cu_seqlens`` are local boundaries of
exactly the rows given, as host ints: a :class:`~gdn_cp.layout.Boundaries` (modes pass the
plan's, so a backend finds its device copies cached on it) or a list / tuple of ints. A
backend never reads device data back to the host.

A backend is any object with these members; ``gdn_cp.ops.reference``, ``gdn_cp.ops.fla`` and
``gdn_cp.ops.flashqla`` are modules that satisfy it (``tests/ops/test_contract.py`` checks each).

Optional members (looked up with ``getattr``; a backend without them works, more slowly):

- ``chunk_state_summary(k, v, g, beta, *, cu_seqlens, use_qk_l2norm) -> [N, Hv, Dk, Dk+Dv]``,
  each sequence's affine state summary ``[M | S_ext]`` computed without a serial scan (the
  reference backend has it). Chunkwise's own exchange then starts the summary all-gather before
  scanning; without it the summary comes from a scan of the slice's last sequence.
- ``native_zigzag_cp_core(group) -> NativeCPCore | None``: like ``native_cp_core`` but on this
  rank's zigzag rows of the whole stream cut as one sequence (parts r and 2*cp-1-r), the
  documents' boundaries as ``cu_seqlens_global``; chunkwise then moves no rows (FLA >= 0.6).
- ``fused_gated_rms_norm() -> callable | None``: ``fn(x [N, D], z [N, D], weight [D], eps) ->
  x / rms(x) * weight * silu(z)`` in one kernel (FLA); the Megatron glue uses it in place of the
  layer's ``out_norm`` then ``* act(z)`` where that is exactly what the layer computes.
- ``check_head_dims(head_k_dim, head_v_dim)``: ValueError where the kernels cannot take these
  head dims (FLA, FlashQLA); ``gdn-cp run`` asks before it spawns ranks.
- ``check_core(shape, dtype)``: ValueError where the kernels cannot take a layer of this
  :class:`~gdn_cp.ops.shape.GDNShape` whose activations are ``dtype`` (FLA: head dims; FlashQLA:
  head dims 128, bf16 / fp16); :func:`gdn_cp.modes.gdn_core` asks before any collective.
- ``native_cp_problem() -> str | None``: why the native cores cannot run in this process (None
  when they can, on a group they take); ``check_native_rows(cu_seqlens_global, cp, conv_width)``:
  ValueError where they cannot take this packing. ``gdn-cp run`` asks both before it spawns.

Which backends there are, and what gdn-cp needs to know of each outside its own files (devices,
availability, precision, preference), is :mod:`gdn_cp.ops.registry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .shape import GDNShape

__all__ = ["Backend", "NativeCPCore", "check_backend"]

_BACKEND_MEMBERS = ("causal_conv1d", "chunk_gated_delta_rule", "native_cp_core")


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


@runtime_checkable
class Backend(Protocol):
    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        cu_seqlens: Sequence[int],
        halo: Optional[torch.Tensor] = None,
        activation: Optional[str] = "silu",
    ) -> torch.Tensor:
        """Depthwise causal conv ``x [T, C]``, ``weight [C, W]`` -> ``[T, C]``, restarting at
        every boundary; ``halo [W-1, C]``: the rows before row 0 in row 0's sequence."""
        ...

    def chunk_gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: Sequence[int],
        scale: Optional[float] = None,
        initial_state: Optional[torch.Tensor] = None,
        output_final_state: bool = False,
        use_qk_l2norm: bool = True,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``, ``initial_state
        [N, Hv, Dk, Dv]`` -> ``(o [T, Hv, Dv], final_state [N, Hv, Dk, Dv] | None)``."""
        ...

    def native_cp_core(self, group) -> Optional[NativeCPCore]:
        """The backend's native context-parallel core for ``group``, or None: then the
        chunkwise mode exchanges halos and state summaries itself through ``gdn_cp.comm``."""
        ...


def check_backend(backend, name: str = "backend") -> None:
    """TypeError unless ``backend`` has the :class:`Backend` members (a cheap attribute check,
    not ``isinstance`` on the protocol; ``gdn_cp.ops.get_backend(name)`` gives one)."""
    missing = [m for m in _BACKEND_MEMBERS if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(
            f"{name} must be a backend (gdn_cp.ops.get_backend('reference'), ('fla') or ('flashqla')), got "
            f"{type(backend).__name__} {backend!r:.60} without {', '.join(missing)}"
        )
