"""gdn-cp's benchmarks: machine-readable results (JSON rows) and plots.

A package run from the repository root, one module each: ``python3 -m benchmarks.layer_full``,
``python3 -m benchmarks.syncs``, ... (``benchmarks/gpu_suite.sh`` runs them so). They import
each other relatively and ``gdn_cp`` (its testing toolkit included) from the checkout they sit in;
never ``tests``.
"""
