"""gdn-cp's testing toolkit: what the tests, ``gdn-cp run``, ``gdn-cp selftest`` and the benchmarks
share, so each of them checks the same thing the same way.

* :mod:`.ranks`: one process-spawning rank pool (CPU gloo; gloo ranks sharing one GPU; NCCL with
  one rank per GPU) that never hangs on a dead or stuck rank;
* :mod:`.metrics`: the relative errors (``max_rel``, ``rel_l2``);
* :mod:`.tolerances`: every limit those errors are held to, with its reason;
* :mod:`.inputs`: seeded inputs of the GDN core and layer, and the CP=1 answer of the core;
* :mod:`.packings`: packed micro-batches (boundaries) and Megatron's zigzag rows;
* :mod:`.results`: machine and versions, JSON files, JSON-lines records;
* :mod:`.megatron` (one package for Megatron): :mod:`.megatron.layer` / :mod:`.megatron.parity` /
  :mod:`.megatron.tp`: the real patched Megatron GatedDeltaNet built on
  a CPU or GPU, run, and compared with CP=1 or with stock megatron-core;
* :mod:`.megatron.model` / :mod:`.megatron.batches` / :mod:`.megatron.training`: Megatron's GPTModel
  and HybridModel with GDN layers from local modules, micro-batches cut by Megatron's own
  ``get_batch_on_this_cp_rank`` in each of its strategies (with TransformerEngine's per-document
  split re-derived in torch), and optimizer steps through Megatron's DDP, schedule and optimizer;
* :mod:`.probes`: the one place outside the library that reads its private details (which
  chunkwise swap point a layer used), for reports.

Nothing under ``gdn_cp.layout``, ``comm``, ``ops``, ``modes`` or ``megatron`` imports this package
(a test checks it): it is the layer between the library and the command line (``gdn-cp run`` and
``selftest`` run on it). Submodules are
imported explicitly (``from gdn_cp.testing.ranks import RankPool``); importing the package alone
imports nothing heavy.
"""
