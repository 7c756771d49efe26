"""gdn-cp: context parallelism for Gated DeltaNet layers on Megatron-Core.

Layers (calls go down, never up): layout -> comm -> ops -> modes -> megatron -> cli.
"""

__version__ = "0.1.0"
