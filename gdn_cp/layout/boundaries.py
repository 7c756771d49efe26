"""Packed-sequence boundaries: the one place where cu_seqlens rules live.

A :class:`Boundaries` value is a tuple of Python ints ``0 = cu[0] <= ... <= cu[-1] = T``:
sequence i is rows ``[cu[i], cu[i+1])`` and equal neighbours are empty padding slots. It is
checked once, when it is made, and trusted from then on. It carries cached views of itself
(an int64 numpy array, CPU tensors, device copies made with the sync-free
:func:`host_to_device`), so whoever holds one (a plan, for one micro-batch) makes each copy
once, and a backend handed one never converts or hashes a list per call.

Two checks add rules for where the boundaries are used:

- :func:`validate_cu_seqlens`: the global boundaries of a zigzag CP split (every length a
  multiple of ``2*cp``). It takes a device tensor: the one device->host read of a micro-batch.
- :func:`host_boundaries`: boundaries of exactly ``total`` rows, given as host ints (what the
  per-rank ops take); a tensor is refused, since reading it would synchronize the device.

The checks run in numpy, a handful of tiny vector ops; the offending index is looked up only
when a check fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..checks import MAX_CP_SIZE, as_int, size_limit_problem
from .device import host_to_device, is_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "PER_DOCUMENT",
    "WHOLE_ROW",
    "THD_SPLITS",
    "Boundaries",
    "check_cp",
    "check_thd_split",
    "host_boundaries",
    "sbhd_cu_seqlens",
    "validate_cu_seqlens",
    "validate_sbhd",
    "zigzag_cut",
]

PER_DOCUMENT = "per_document"
"""THD split: every packed sequence (document) was cut into 2*cp parts on its own (Megatron's
``_get_batch_on_this_cp_rank_per_document_balancing``, TransformerEngine's
``thd_get_partitioned_indices``: what ``--sft`` does). Every sequence length must divide by 2*cp."""

WHOLE_ROW = "whole_row"
"""THD split: the whole packed row was cut into 2*cp parts as if it were one sequence, while the
sequence boundaries stay where the documents are (Megatron's
``_get_batch_on_this_cp_rank_per_sequence_balancing`` with ``cu_seqlens``: what
``--dataloader-inter-document-masking`` and hybrid CP do). Only the row length must divide by 2*cp."""

THD_SPLITS = (PER_DOCUMENT, WHOLE_ROW)

MAX_ROWS = 1 << 62
"""Largest row count (and boundary) accepted: index arithmetic on boundaries (``start + length``,
``(cp + 1) * T_local``) stays inside int64 with headroom."""

MAX_BATCH = 1 << 20
"""Largest SBHD batch accepted (its boundaries hold B+1 entries)."""

# MAX_CP_SIZE (the largest CP size accepted) lives in gdn_cp.checks, the one place of size limits.


class Boundaries(tuple):
    """Checked boundaries ``(0, end_0, end_1, ..., T)`` as a tuple of ints, with cached views.

    ``Boundaries(values)`` checks ``values`` (ints, at least two, starting at 0, never
    decreasing) and raises TypeError / ValueError naming the fix. A Boundaries passed in is
    returned as it is. Views (:meth:`numpy`, :meth:`cpu`, :meth:`on`) are shared by every
    caller: treat them as read-only.
    """

    def __new__(cls, values, *, name: str = "cu_seqlens"):
        if isinstance(values, Boundaries):
            return values
        return cls._from_array(_host_int64(values, name, allow_tensor=False), name)

    @classmethod
    def _from_array(cls, cu: np.ndarray, name: str) -> "Boundaries":
        """Check an int64 array and wrap it (the array is kept as the numpy view)."""
        _check_structure(cu, name)
        self = super().__new__(cls, cu.tolist())
        cu.flags.writeable = False
        self._array = cu
        self._views = {}
        self._nonempty = None
        return self

    def __reduce__(self):
        return (Boundaries, (tuple(self),))  # caches (device copies) are not pickled

    def __repr__(self) -> str:
        return f"Boundaries({tuple.__repr__(self)})"

    @property
    def total(self) -> int:
        """T, the number of rows the boundaries cover."""
        return self[-1]

    @property
    def num_sequences(self) -> int:
        return len(self) - 1

    def numpy(self) -> np.ndarray:
        """int64 ``[n+1]``, read-only."""
        return self._array

    def cpu(self, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """A CPU tensor ``[n+1]`` of ``dtype`` (default int64; its own memory; made once)."""
        import torch

        dtype = torch.int64 if dtype is None else dtype
        key = ("cpu", dtype)
        if key not in self._views:
            self._views[key] = torch.tensor(self._array, dtype=dtype)
        return self._views[key]

    def on(self, device, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """The boundaries on ``device`` (default dtype int64; host->device once per device and dtype;
        never read back)."""
        import torch

        device, dtype = torch.device(device), torch.int64 if dtype is None else dtype
        if device.type == "cpu":
            return self.cpu(dtype)
        key = (str(device), dtype)
        if key not in self._views:
            self._views[key] = host_to_device(self.cpu(dtype), device)
        return self._views[key]

    def positions(self, device) -> "torch.Tensor":
        """int32 ``[T]`` on ``device``: each row's offset from the first row of its sequence (what a
        causal conv masks its taps with). Made on the host from the boundaries, copied once per device
        (never read back)."""
        import torch

        key = ("positions", str(torch.device(device)))
        if key not in self._views:
            cu = self._array
            rows = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], np.diff(cu))
            self._views[key] = host_to_device(torch.from_numpy(rows.astype(np.int32)), device)
        return self._views[key]

    def nonempty(self) -> tuple["Boundaries", tuple[int, ...]]:
        """These boundaries without empty sequences, and the indices of the sequences kept."""
        if self._nonempty is None:
            keep = tuple(i for i in range(len(self) - 1) if self[i + 1] > self[i])
            if len(keep) == len(self) - 1:
                self._nonempty = (self, keep)
            else:
                self._nonempty = (Boundaries((0,) + tuple(self[i + 1] for i in keep)), keep)
        return self._nonempty


def _short(cu, n: int = 12) -> str:
    cu = [int(c) for c in cu]
    return str(cu) if len(cu) <= n else f"[{', '.join(map(str, cu[:n]))}, ... ({len(cu)} entries)]"


def _host_int64(values, name: str, *, allow_tensor: bool) -> np.ndarray:
    if is_tensor(values):
        import torch

        if not allow_tensor:
            raise TypeError(
                f"{name} must be Python ints (a list, tuple or Boundaries), got a torch.Tensor on "
                f"{values.device}; reading it here would synchronize the device on every call: convert "
                f"it once per micro-batch ({name}.tolist(), or a RouteCache plan's boundaries) and pass that"
            )
        if values.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor of boundaries, got shape {tuple(values.shape)}; "
                f"pass [0, end_0, end_1, ..., T_global]"
            )
        if values.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            raise TypeError(f"{name} must have an integer dtype, got {values.dtype}; use torch.int32 or torch.int64")
        if values.is_meta:
            raise ValueError(
                f"{name} is on the meta device, which holds shapes but no values; pass the boundaries "
                f"on the CPU or the GPU"
            )
        # The single device->host transfer of the micro-batch (a copy: never the caller's memory).
        return values.detach().cpu().numpy().astype(np.int64)
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        if values.dtype.kind == "u" and len(values) and values.max() > MAX_ROWS:
            _raise_out_of_range(name, int(np.argmax(values > MAX_ROWS)), int(values.max()))
        return values.astype(np.int64)
    if not isinstance(values, (list, tuple, range)):
        raise TypeError(f"{name} must be a list of ints (or a 1-D integer tensor), got {type(values).__name__}")
    ints = []
    for i, v in enumerate(values):
        value = as_int(v)
        if value is None:
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r}; pass Python ints") from None
        if not -MAX_ROWS <= value <= MAX_ROWS:
            _raise_out_of_range(name, i, value)
        ints.append(value)
    return np.array(ints, dtype=np.int64)


def _raise_out_of_range(name: str, i: int, value: int) -> None:
    why = " (negative)" if value < 0 else ""
    raise ValueError(f"{name}[{i}]={value} is out of range{why}: boundaries are row offsets in [0, 2**62]")


def _check_structure(cu: np.ndarray, name: str) -> None:
    if len(cu) < 2:
        raise ValueError(
            f"{name} needs at least 2 boundaries [0, ..., T], got {_short(cu)}; for one sequence of T rows pass [0, T]"
        )
    if cu[0] != 0:
        raise ValueError(
            f"{name}[0] must be 0, got {int(cu[0])}; boundaries are offsets into the packed rows, so they start at 0"
        )
    negative = cu < 0
    if negative.any():
        i = int(np.argmax(negative))
        _raise_out_of_range(name, i, int(cu[i]))
    falls = cu[1:] < cu[:-1]
    if falls.any():
        i = int(np.argmax(falls)) + 1
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i}]={int(cu[i])} < {name}[{i - 1}]={int(cu[i - 1])}; "
            f"pass cumulative sums of the sequence lengths (equal neighbours are empty slots)"
        )
    if cu[-1] > MAX_ROWS:  # a tensor's values are only seen here
        _raise_out_of_range(name, len(cu) - 1, int(cu[-1]))


_NO_RANK = object()


def check_cp(cp_size, cp_rank=_NO_RANK) -> None:
    """The one check of a CP size (an int in ``[1, MAX_CP_SIZE]``) and, when given (None is not a
    rank), a rank in ``[0, cp_size)``."""
    if as_int(cp_size) is None or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    too_large = size_limit_problem(cp_size, MAX_CP_SIZE, "CP group")
    if too_large:
        raise ValueError(f"cp_size={cp_size} is {too_large}")
    if cp_rank is not _NO_RANK and (as_int(cp_rank) is None or not 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def host_boundaries(cu_seqlens, total: int | None = None, *, name: str = "cu_seqlens") -> Boundaries:
    """``cu_seqlens`` (host ints or Boundaries) as Boundaries, ending at ``total`` rows when given.

    What the per-rank ops call on their ``cu_seqlens``: a Boundaries costs one int compare.
    """
    cu = Boundaries(cu_seqlens, name=name)
    if total is not None and as_int(total) is None:
        raise TypeError(f"total (the number of rows) must be an int or None, got {type(total).__name__} {total!r}")
    if total is not None and cu[-1] != total:
        raise ValueError(
            f"{name} must end at the number of rows T={total}, got {name}[-1]={cu[-1]} in {_short(cu)}; "
            f"the inputs' row count and the boundaries disagree (pass the boundaries of exactly these rows)"
        )
    return cu


def check_thd_split(split) -> str:
    """``split`` if it is one of :data:`THD_SPLITS`, else ValueError listing them."""
    if not isinstance(split, str) or split not in THD_SPLITS:
        raise ValueError(f"split must be one of {THD_SPLITS} (how the zigzag rows were cut), got {split!r}")
    return split


def validate_cu_seqlens(
    cu_seqlens, cp_size: int, *, split: str = PER_DOCUMENT, t_global: int | None = None, name: str = "cu_seqlens"
) -> Boundaries:
    """Check global packed boundaries for a zigzag CP split over ``cp_size`` ranks.

    ``cu_seqlens``: a 1-D integer tensor (any device: read to the host here, once), a list of
    ints, or Boundaries (then only the rules below are checked). Rules, each violation a
    ValueError naming the value and the fix: the :class:`Boundaries` rules, ends at
    ``t_global`` when given, and, when ``cp_size > 1``, the zigzag cut of ``split`` is possible:
    every sequence length divisible by ``2 * cp_size`` (:data:`PER_DOCUMENT`) or the total
    ``T_global`` (:data:`WHOLE_ROW`); so ``T_global`` is divisible by ``cp_size``. One rank cuts
    nothing: any lengths pass.
    """
    check_cp(cp_size)
    check_thd_split(split)
    if isinstance(cu_seqlens, Boundaries):
        cu = cu_seqlens
    else:
        cu = Boundaries._from_array(_host_int64(cu_seqlens, name, allow_tensor=True), name)
    if t_global is not None and cu[-1] != t_global:
        raise ValueError(
            f"{name}[-1]={cu[-1]} must equal the packed length T_global={t_global}; "
            f"pass the padded boundaries (cu_seqlens_q_padded) that cover every row"
        )
    if cp_size == 1:
        return cu  # nothing was cut: any lengths (stock megatron-core takes odd ones at CP=1 too)
    step = 2 * cp_size
    if split == WHOLE_ROW:
        if cu.total % step:
            raise ValueError(
                f"the packed row of {name} has T_global={cu.total} rows, not divisible by 2*cp={step}: a whole-row "
                f"zigzag cut needs the row padded to a multiple of {step} (Megatron: --seq-length)"
            )
        return cu
    lengths = np.diff(cu.numpy())
    bad = lengths % step != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"sequence {i} of {name} has length {int(lengths[i])}, not divisible by 2*cp={step}; "
            f"pad every sequence to a multiple of {step} (Megatron: cu_seqlens_q_padded)"
        )
    # T_global % cp == 0 follows from the rule above.
    return cu


def validate_sbhd(seq_len: int, batch: int, cp_size: int) -> Boundaries:
    """SBHD input (global length ``seq_len``, ``batch`` sequences) as zigzag-checked boundaries.

    The SBHD form of :func:`validate_cu_seqlens`: its one length rule (``seq_len`` divisible by
    ``2 * cp_size``) is said in SBHD's own terms (there are no packed boundaries to pad)."""
    check_cp(cp_size)
    cu = sbhd_cu_seqlens(seq_len, batch)
    if cp_size > 1 and seq_len % (2 * cp_size):  # one rank cuts nothing, as for validate_cu_seqlens
        raise ValueError(
            f"SBHD sequence length seq_len={seq_len} is not divisible by 2*cp={2 * cp_size}: the zigzag split cuts "
            f"the sequence into 2*cp equal parts; pad the sequence dimension S to a multiple of {2 * cp_size}"
        )
    return validate_cu_seqlens(cu, cp_size, name="sbhd boundaries")


def zigzag_cut(cu: Boundaries, split: str) -> Boundaries:
    """The boundaries the zigzag parts were cut from: ``cu`` itself (:data:`PER_DOCUMENT`) or the
    whole row as one sequence, ``(0, T)`` (:data:`WHOLE_ROW`). Routes and natural-order maps are
    built from these; the recurrence restarts at ``cu`` in both."""
    return cu if check_thd_split(split) == PER_DOCUMENT else Boundaries((0, cu.total))


def sbhd_cu_seqlens(seq_len: int, batch: int) -> Boundaries:
    """SBHD as packed THD: batch element b is sequence b, so ``[S, B]`` b-major is ``[B*S]``.

    ``seq_len``: an int >= 0 (the global S); ``batch``: an int in ``[1, MAX_BATCH]``. Returns
    ``(0, S, 2S, ..., B*S)``.
    """
    for name, value, low, high in (("seq_len", seq_len, 0, MAX_ROWS), ("batch", batch, 1, MAX_BATCH)):
        if as_int(value) is None or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    seq_len, batch = as_int(seq_len), as_int(batch)  # Python ints: the product below must not wrap
    if seq_len * batch > MAX_ROWS:
        raise ValueError(f"seq_len * batch = {seq_len} * {batch} rows is out of range (at most 2**62)")
    return Boundaries(range(0, seq_len * batch + 1, seq_len) if seq_len else [0] * (batch + 1))
