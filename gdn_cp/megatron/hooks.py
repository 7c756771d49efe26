"""What the pinned megatron-core patch calls, and nothing else: the patched files import this one
module (through their one import guard, ``megatron.core.utils.gdn_cp_hooks``), so gdn-cp may move,
rename or add anything behind these names (a mode, a backend, a module) without the patch changing.

* ``TransformerConfig.__post_init__`` -> :func:`configure_transformer_config` (gdn-cp's settings
  checked against its registries, ``auto`` resolved, the heads against TP / CP);
* ``GatedDeltaNet.forward`` -> :func:`gated_delta_net_forward`;
* ``megatron.training.arguments.validate_args`` -> :func:`configure_megatron_lm_args`;
* ``megatron.core.utils.get_batch_on_this_cp_rank`` -> :func:`cut_packed_rows` and :func:`record_split`.
"""

from __future__ import annotations

from .config import configure_linear_cp_mode as configure_transformer_config
from .document_padding import cut_packed_rows
from .gdn import gated_delta_net_forward
from .thd_split import configure_megatron_lm_args, record_split

__all__ = ["configure_megatron_lm_args", "configure_transformer_config", "cut_packed_rows", "gated_delta_net_forward",
           "record_split"]
