"""gdn-cp's settings: one value, read and checked once where a call comes in, handed down with it.

| field | read from | values |
| --- | --- | --- |
| ``mode`` | ``TransformerConfig.linear_cp_mode`` (``gdn_core(mode=...)``) | a mode of :mod:`.spec`, or ``auto`` (resolved when the config is built) |
| ``thd_split`` | ``TransformerConfig.linear_cp_thd_split`` | None, ``per_document``, ``whole_row`` |
| ``backend`` | ``TransformerConfig.linear_cp_backend`` (absent: ``auto``) | ``auto`` or a backend of :mod:`gdn_cp.ops.registry` (resolved once per layer, for its device: :func:`gdn_cp.megatron.backend.choose_backend`) |
| ``deterministic`` | ``TransformerConfig.deterministic_mode`` | True: the plain-torch reference backend |
| ``chunkwise_path`` | ``GDN_CP_CHUNKWISE_PATH`` (``gdn_core(chunkwise_path=...)``) | ``auto``, ``native``, ``generic`` |
| ``chunkwise_swap`` | ``GDN_CP_CHUNKWISE_SWAP`` | ``auto``, ``hidden``, ``core`` |
| ``glue`` | ``GDN_CP_GLUE`` | ``auto``, ``triton``, ``compiled``, ``unfused`` (resolved per device by :func:`gdn_cp.ops.fused.glue_path`) |
| ``backend_settings`` | every backend's ``GDN_CP_*`` settings (its spec's ``settings``: ``GDN_CP_FLASHQLA_AUTO_CP``) | ``(variable, value)`` pairs, handed to ``gdn_cp.ops.get_backend`` |

:class:`Settings` checks every field when it is made (ValueError / TypeError naming the field, the
value and what it takes); whoever holds one trusts it. The patched Megatron forward reads it once per
layer with :func:`gdn_cp.megatron.rules.read_settings` (the config's fields and the environment, on the
layer's first call), :func:`gdn_cp.modes.gdn_core` from its arguments and the environment. Nothing
below them reads a setting anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .. import env
from ..env import CHUNKWISE_PATH_ENV, CHUNKWISE_PATHS, CHUNKWISE_SWAP_ENV, GLUE_CHOICES, GLUE_ENV, SWAP_POINTS
from ..layout.boundaries import THD_SPLITS, WHOLE_ROW
from ..ops.registry import AUTO as AUTO_BACKEND
from ..ops.registry import BACKEND_CHOICES, BACKENDS, backend_settings, unknown_backend_error
from .spec import AUTO, MODES, unknown_mode_error

__all__ = ["THD_SPLIT_FIELD", "Settings", "check_thd_split_setting"]
THD_SPLIT_FIELD = "linear_cp_thd_split"
"""The TransformerConfig field (and, as ``--linear-cp-thd-split``, the Megatron-LM flag)."""


def check_thd_split_setting(value: Any, name: str = THD_SPLIT_FIELD) -> Optional[str]:
    """``value`` if it is None or one of the THD splits; ValueError naming ``name`` otherwise."""
    if value is None or (isinstance(value, str) and value in THD_SPLITS):
        return value
    raise ValueError(
        f"{name}={value!r} is not a THD split; set it to one of {', '.join(map(repr, THD_SPLITS))} or None "
        f"(None: the split Megatron's get_batch_on_this_cp_rank recorded, else {WHOLE_ROW!r} with hybrid CP, "
        f"else an error at CP > 1)"
    )


def _one_of(name: str, value: Any, choices: tuple[str, ...], where: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} ({where}) must be one of {', '.join(choices)}")


@dataclass(frozen=True)
class Settings:
    """gdn-cp's settings for one layer call (see the module docstring for where each comes from)."""

    mode: str
    thd_split: Optional[str] = None
    backend: str = AUTO_BACKEND
    deterministic: bool = False
    chunkwise_path: str = "auto"
    chunkwise_swap: str = "auto"
    glue: str = "auto"
    backend_settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or (self.mode != AUTO and self.mode not in MODES):
            raise unknown_mode_error(self.mode)
        check_thd_split_setting(self.thd_split, f"TransformerConfig.{THD_SPLIT_FIELD}")
        if not isinstance(self.backend, str) or self.backend not in BACKEND_CHOICES:
            raise unknown_backend_error(self.backend, "TransformerConfig.")
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic_mode={self.deterministic!r} must be True or False")
        _one_of("chunkwise_path", self.chunkwise_path, CHUNKWISE_PATHS, CHUNKWISE_PATH_ENV)
        _one_of("chunkwise_swap", self.chunkwise_swap, SWAP_POINTS, CHUNKWISE_SWAP_ENV)
        _one_of("glue", self.glue, GLUE_CHOICES, GLUE_ENV)
        known = {var for spec in BACKENDS.values() for var in spec.settings}
        if not isinstance(self.backend_settings, tuple) or any(
                not isinstance(pair, tuple) or len(pair) != 2 or pair[0] not in known for pair in self.backend_settings):
            raise ValueError(f"backend_settings={self.backend_settings!r} must be (variable, value) pairs of the "
                             f"backends' settings ({', '.join(sorted(known))}): gdn_cp.ops.registry.backend_settings()")

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None, **fields) -> Settings:
        """``Settings(**fields)`` with the chunkwise path, the swap point, the glue and the backends' settings the
        environment sets (a field given here wins); a bad variable is a ValueError naming it."""
        fields.setdefault("chunkwise_path", env.read(CHUNKWISE_PATH_ENV, environ))
        fields.setdefault("chunkwise_swap", env.read(CHUNKWISE_SWAP_ENV, environ))
        fields.setdefault("glue", env.read(GLUE_ENV, environ))
        fields.setdefault("backend_settings", backend_settings(environ))
        return cls(**fields)
