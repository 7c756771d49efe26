"""The testing toolkit's Megatron part: the real patched megatron-core GatedDeltaNet and models built
on a CPU or a GPU, run, and compared with CP=1 or with stock megatron-core.

* :mod:`.layer`: one GatedDeltaNet (local or TransformerEngine submodules) and the CPU / one-GPU
  stand-ins megatron-core needs; :mod:`.tp`: its weights split over TP, Megatron's rank grid;
* :mod:`.parity`: a layer under gdn-cp against CP=1 (and TP=1) on the same weights and inputs;
* :mod:`.model` / :mod:`.batches` / :mod:`.training`: GPTModel and HybridModel with GDN layers,
  micro-batches cut by Megatron's own ``get_batch_on_this_cp_rank``, optimizer steps;
* :mod:`.lm`: Megatron-LM's own training scripts launched on gloo or NCCL ranks; :mod:`.byte_text`: the
  text they train on (the Python standard library's source, byte-level, as a Megatron indexed dataset).

Submodules are imported explicitly; importing this package imports nothing (megatron-core is
imported by the submodules, inside the ranks that need it).
"""
