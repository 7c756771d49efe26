"""gdn-cp's testing toolkit: what the tests and the benchmarks share, so each of them checks the same
thing the same way. Test-only: it lives beside the package, not in it (the wheel does not ship it;
nothing under ``gdn_cp`` imports it, tests/test_layers.py checks that), and runs from a clone (the
repository root on ``sys.path``: pytest's root, ``python3 -m benchmarks.<name>``).

* :mod:`.ranks`: one process-spawning rank pool (CPU gloo; gloo ranks sharing one GPU; NCCL with
  one rank per GPU) that never hangs on a dead or stuck rank, with the tests' collective shims
  (counting, FLA's outputs viewed flat on gloo);
* :mod:`.env`: the tests' and benchmarks' ``GDN_CP_*`` variables (the library's are :mod:`gdn_cp.env`);
* :mod:`.inputs` / :mod:`.packings`: seeded inputs of the FLA kernels and the Megatron layer, the CP=1
  answer of the core, named packed micro-batches and Megatron's zigzag rows written out
  independently of :mod:`gdn_cp.layout` (the core's inputs and the main job's micro-batch are
  :mod:`gdn_cp.modes.inputs`; errors and tolerances :mod:`gdn_cp.ops.accuracy`);
* :mod:`.results`: machine and versions, JSON files, JSON-lines records;
* :mod:`.probes`: looks into a run that the library does not offer (swap points, all-to-all bytes,
  plan builds) and an environment setting for a block; :mod:`.stand_ins`: a GatedDeltaNet stand-in
  for what the patched forward checks before any collective;
* :mod:`.megatron` (one package for Megatron): :mod:`.megatron.layer` / :mod:`.megatron.parity` /
  :mod:`.megatron.tp`: the real patched Megatron GatedDeltaNet built on a CPU or GPU, run, and
  compared with CP=1 or with stock megatron-core; :mod:`.megatron.model` / :mod:`.megatron.batches` /
  :mod:`.megatron.training`: Megatron's GPTModel and HybridModel with GDN layers from local modules,
  micro-batches cut by Megatron's own ``get_batch_on_this_cp_rank``, optimizer steps through
  Megatron's DDP, schedule and optimizer; :mod:`.megatron.lm`: Megatron-LM's own training scripts.

Submodules are imported explicitly (``from gdn_cp_testing.ranks import RankPool``); importing the
package alone imports nothing heavy.
"""
