"""Megatron-Core glue. What the pinned patch calls is :mod:`.hooks`, and only that. Behind it:

* config time (:mod:`.config`): the ``TransformerConfig`` hook, ``auto`` resolved once, a named backend
  checked against the machine; the rules a config and a layer share (:mod:`.rules`);
* the patched GatedDeltaNet forward (:mod:`.gdn`): the layer's state, read on its first call
  (:mod:`.layer`; ``reset_settings`` makes layers read them again), one call's checks and context (:mod:`.call`), the per-token work the mode runs
  (:mod:`.segment`);
* the THD cut (:mod:`.thd_split`), documents padded and cut per document (:mod:`.document_padding`),
  out_norm's gradient sum over TP (:mod:`.tp_grads`). The supported megatron-core releases, with
  everything read from them, are :mod:`gdn_cp.pins` (below this package, so the patch tool reads them alone).

Installing / checking / reverting the pinned patch is a tool of its own, off the forward path:
:mod:`gdn_cp.patch`. Importing this package imports no torch (:mod:`.config`, :mod:`.rules` and
:mod:`gdn_cp.pins` are torch-free).
"""

from __future__ import annotations

from .config import configure_linear_cp_mode, explain_linear_cp_modes, resolve_linear_cp_mode
from .rules import check_linear_cp_mode

__all__ = ["check_linear_cp_mode", "configure_linear_cp_mode", "explain_linear_cp_modes", "resolve_linear_cp_mode"]
