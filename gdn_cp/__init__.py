"""gdn-cp: context parallelism for Gated DeltaNet layers on Megatron-Core.

Layers (calls go down, never up): layout -> comm -> ops -> modes -> megatron -> cli.
Below them all, importing nothing of gdn_cp: ``checks`` (the integer-argument rule), ``env``
(the GDN_CP_* environment variables) and ``nvtx``; just above them ``pins`` (the supported
megatron-core releases: their patch folders and adapters; it imports ``checks`` alone). Off to the side,
above megatron and off the forward path: ``patch``, the tool that installs, checks and reverts the
pinned Megatron-Core patch (the CLI, the tests and the benchmarks use it); it imports ``pins`` and
nothing of the forward path, so ``import gdn_cp.patch`` loads a handful of modules and no torch. ``tests/test_layers.py``
holds the package to this order.
"""

__version__ = "0.1.0"

INSTALL_HINT = (
    "install gdn-cp from a clone of its repository (it is not on a package index yet): "
    "`pip install -e <clone>`, with the extras you need, e.g. `pip install -e '<clone>[megatron,fla]'`"
)
"""How to install gdn-cp, said the same way everywhere: the README, and the ImportError of a patched
megatron-core whose gdn_cp cannot be imported (the patch carries a copy of this text, since gdn_cp is
what is missing then; ``tests/test_readme.py`` keeps the copies equal)."""
