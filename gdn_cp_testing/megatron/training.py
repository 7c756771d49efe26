"""Training steps as Megatron-LM takes them, for the end-to-end tests: the model wrapped in
megatron-core's ``DistributedDataParallel``, each step through megatron-core's own schedule
(``get_forward_backward_func()``: forward_step, loss, backward, then ``finalize_model_grads``
with the token count) and its own optimizer (``get_megatron_optimizer``), on Megatron's process
groups (``parallel_state.initialize_model_parallel``, once per topology: :func:`megatron_parallel_state`).

What differs from a GPU run, and why:

* ``calculate_per_token_loss=True`` (required by ``--hybrid-context-parallel``) as a rule: DDP sums
  gradients over the data- and context-parallel ranks and ``finalize_model_grads`` divides them by
  the all-reduced token count, so the step does not depend on how the tokens are split. Without it
  (``per_token_loss=False``) the schedule divides each micro-batch's loss by that rank's own token
  count, as Megatron-LM does; CP sizes then agree only where every rank counts the same tokens;
* the loss is ``pretrain_gpt.loss_func``'s (sum of ``losses * loss_mask`` and the token count)
  without its ``.float()``: an fp64 run stays fp64;
* ``clip_grad=0``: megatron-core 0.19.2 clips only fp32 gradients (``clip_grad_by_total_norm_fp32``
  asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``), so an fp64 run cannot clip, on a
  GPU either. The gradient norm is still computed (fp32, megatron's ``get_grad_norm_fp32``);
* megatron-core's schedule, optimizer and its local l2-norm make a few small tensors with a
  literal ``device="cuda"`` (the token count, the loss scale, the gradient norm): on a CPU-only
  torch these raise, so :func:`cuda_literals_on_cpu` maps that literal to the CPU around the
  optimizer's construction, the schedule and the step (test processes only). Everything else of
  the step is megatron-core's code.
"""

from __future__ import annotations

import contextlib
import re
from functools import partial
from typing import Callable, Iterable

import torch

__all__ = [
    "TRAIN_LR",
    "cuda_literals_on_cpu",
    "loss_func_like_pretrain_gpt",
    "megatron_parallel_state",
    "train_steps",
]

TRAIN_LR = 1e-2

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


@contextlib.contextmanager
def cuda_literals_on_cpu():
    """Inside: ``torch.tensor / zeros / ones / empty / full(..., device="cuda")`` make CPU tensors
    (see the module docstring); any other device is untouched; ``torch.cuda.synchronize`` does nothing
    (the pipeline schedule's shape exchange calls it). Restored on exit. Does nothing where CUDA is
    available."""
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch, name) for name in _FACTORIES}

    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
                device = "cpu"
            return factory(*args, device=device, **kwargs)

        return make

    for name, factory in saved.items():
        setattr(torch, name, on_cpu(factory))
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # the pipeline's shape exchange syncs the device it has not
    try:
        yield
    finally:
        for name, factory in saved.items():
            setattr(torch, name, factory)
        torch.cuda.synchronize = synchronize


_PARALLEL_STATES: dict = {}  # (world, tp, cp, pp, ep) -> parallel_state's globals after initialize_model_parallel


def _state_names(parallel_state) -> list[str]:
    """The module globals that hold megatron-core's parallel state (``_TENSOR_MODEL_PARALLEL_GROUP``,
    ``_GLOBAL_MEMORY_BUFFER``, ..., ``_global_process_group_list``)."""
    return [n for n in vars(parallel_state) if re.fullmatch(r"_[A-Z][A-Z0-9_]*|_global_process_group_list", n)]


@contextlib.contextmanager
def megatron_parallel_state(context_parallel_size: int, tensor_model_parallel_size: int = 1,
                            pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1):
    """megatron-core's ``parallel_state`` on this process's world: TP, CP, PP and EP as given, DP
    the rest (Megatron's rank order ``tp-cp-ep-dp-pp``; EP folds over DP x CP). Every rank must enter
    it together.

    Each ``initialize_model_parallel`` creates dozens of process groups and ``destroy_model_parallel``
    only drops the references (torch keeps every group, and a gloo group its threads, until it is
    destroyed): a rank pool that initialized per case grew to 1,168 threads per rank. So the state
    is made once per topology and process, then re-installed, and its groups are those of
    :func:`gdn_cp_testing.ranks.shared_process_groups` (one per rank set, shared with the pool's
    and the other topologies'). On exit the state found on entry is put back; each entry gets a
    fresh global memory buffer, as ``initialize_model_parallel`` makes one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gdn_cp_testing.ranks import shared_process_groups

    names = _state_names(parallel_state)
    outside = {n: getattr(parallel_state, n) for n in names}
    key = (dist.get_world_size(), tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size,
           expert_model_parallel_size)
    try:
        for n, value in outside.items():  # a clean slate, without destroying anything
            setattr(parallel_state, n, {} if isinstance(value, dict) else None)
        if key not in _PARALLEL_STATES:
            with shared_process_groups():
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                                         context_parallel_size=context_parallel_size,
                                                         pipeline_model_parallel_size=pipeline_model_parallel_size,
                                                         expert_model_parallel_size=expert_model_parallel_size)
            _PARALLEL_STATES[key] = {n: getattr(parallel_state, n) for n in names}
        else:
            for n, value in _PARALLEL_STATES[key].items():
                if n != "_GLOBAL_MEMORY_BUFFER":
                    setattr(parallel_state, n, value)
            parallel_state._set_global_memory_buffer()
        yield parallel_state
    finally:
        for n, value in outside.items():
            setattr(parallel_state, n, value)


def loss_func_like_pretrain_gpt(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``pretrain_gpt.loss_func`` (core_v0.19.0) without the ``.float()`` casts: ``(sum of
    losses * loss_mask, the token count, {"lm loss": [sum, count]})``."""
    losses = output_tensor.view(-1)
    mask = loss_mask.view(-1).to(losses.dtype)
    loss = torch.sum(losses * mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    """``pretrain_gpt.forward_step`` on an iterator of :class:`gdn_cp_testing.megatron.batches.Cut`
    (batch already cut by Megatron's get_batch_on_this_cp_rank, PackedSeqParams built as
    forward_step builds them)."""
    cut = next(data_iterator)
    b = cut.batch
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"],
                   packed_seq_params=cut.packed_seq_params)
    return output, partial(loss_func_like_pretrain_gpt, b["loss_mask"])


def train_steps(build: Callable, micro_batches: Callable[[int], Iterable], steps: int, *, seq_length: int,
                lr: float = TRAIN_LR, micro_batch_size: int = 1, per_token_loss: bool = True) -> dict:
    """``steps`` optimizer steps of the model ``build(pg_collection)`` returns (its config must have
    ``calculate_per_token_loss=per_token_loss``), inside :func:`megatron_parallel_state`.
    ``seq_length`` / ``micro_batch_size``: what Megatron-LM hands the schedule (``args.seq_length``,
    ``args.micro_batch_size``): the pipeline's fixed activation shape is ``[seq_length / cp,
    micro_batch_size, hidden]`` unless the config has ``variable_seq_lengths``.

    ``micro_batches(step)``: this rank's Cuts of that step (one per micro-batch). Returns
    ``{"loss": [per step: the token-mean loss over every micro-batch and data/CP rank],
    "grad_norm": [per step], "params": {name: the final parameter}, "moved": max |final -
    initial| over every parameter}``.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    model = build(ProcessGroupCollection.use_mpu_process_groups())
    config = model.config
    if config.calculate_per_token_loss != per_token_loss:
        raise ValueError(f"train_steps(per_token_loss={per_token_loss}) got a config with calculate_per_token_loss="
                         f"{config.calculate_per_token_loss} (see the module docstring)")
    config.finalize_model_grads_func = finalize_model_grads
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=False, fp16=False,
                                 params_dtype=config.params_dtype, clip_grad=0.0)
    with cuda_literals_on_cpu():
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    losses, norms = [], []
    for step in range(steps):
        cuts = list(micro_batches(step))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with cuda_literals_on_cpu():
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(cuts), model=[ddp], num_microbatches=len(cuts),
                seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False,
            )
            ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"megatron's optimizer step {step} was not successful")
        # the loss reports come from the last pipeline stage only: the other stages add zeros
        total = (torch.stack([r["lm loss"] for r in reports]).sum(0) if reports
                 else torch.zeros(2, dtype=config.params_dtype))
        torch.distributed.all_reduce(total, group=dp_cp)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        losses.append(float(total[0] / total[1]))
        norms.append(float(grad_norm))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max(float((params[n] - initial[n]).abs().max()) for n in params)
    return {"loss": losses, "grad_norm": norms, "params": params, "moved": moved}
