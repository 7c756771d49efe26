"""The per-token glue around the GDN core (gates, conv + SiLU + q/k/v split + l2 norm): one plain-torch
function per step, and the ways a GPU runs it (gdn-cp's Triton kernels, torch.compile, or the backend's
kernels unfused), chosen by ``GDN_CP_GLUE`` (:mod:`.glue`)."""

from .glue import CUDA_DEFAULT, GLUE_PATHS, L2NORM_EPS, conv_silu_split, gated_rms_norm, gates, glue_path

__all__ = ["CUDA_DEFAULT", "GLUE_PATHS", "L2NORM_EPS", "conv_silu_split", "gated_rms_norm", "gates", "glue_path"]
