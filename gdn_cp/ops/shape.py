"""The head shape of a GDN core: the one place for the grouped-heads rule.

Torch-free. Channels of the pre-conv ``qkv [T, C]`` are ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]``;
value head h reads key head ``h // (Hv // Hk)`` (Megatron's ``repeat_interleave``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import as_int

__all__ = ["GDNShape", "value_heads_per_key_head"]


def value_heads_per_key_head(num_k_heads: int, num_v_heads: int) -> int:
    """``Hv // Hk``; ValueError unless Hv is a positive multiple of Hk (grouped value heads)."""
    for name, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads)):
        if as_int(value) is None:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    num_k_heads, num_v_heads = as_int(num_k_heads), as_int(num_v_heads)
    if num_k_heads < 1 or num_v_heads < 1 or num_v_heads % num_k_heads:
        raise ValueError(
            f"num_v_heads={num_v_heads} must be a positive multiple of num_k_heads={num_k_heads} "
            f"(value head h reads key head h // (num_v_heads // num_k_heads)); choose head counts that divide "
            f"(Megatron: linear_num_value_heads, linear_num_key_heads)"
        )
    return num_v_heads // num_k_heads


@dataclass(frozen=True)
class GDNShape:
    """Head layout of the GDN core on one TP rank, and whether q/k are l2-normalized."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    qk_l2norm: bool = True

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if as_int(value) is None or value < 1:
                raise ValueError(f"GDNShape.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, as_int(value))  # a NumPy integer is stored as an int
        if not isinstance(self.qk_l2norm, bool):
            raise TypeError(f"GDNShape.qk_l2norm must be True or False, got {self.qk_l2norm!r}")
        value_heads_per_key_head(self.num_k_heads, self.num_v_heads)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim
