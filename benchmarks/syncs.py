"""Device->host synchronizations per GatedDeltaNet layer call on packed (THD) input.

Patched megatron-core 0.19.2 (every ``linear_cp_mode``) against stock 0.19.2 headwise, on a
CUDA machine with FLA: each rank builds two GDN layers, runs the first on the micro-batch
(it builds the routes), then counts the syncs of the second layer's forward and backward
with ``torch.cuda.set_sync_debug_mode("warn")``. Collectives are excluded: with gloo ranks on
one GPU, gloo stages CUDA tensors through the host, which NCCL does not (the rank pool of
``gdn_cp_testing.ranks`` suspends the sync check while a collective runs and counts the collectives).

    python3 -m benchmarks.syncs      # needs CUDA + FLA + megatron; exit 2 without a GPU

Counts do not depend on kernel configs: ``GDN_CP_TEST_FAST_AUTOTUNE=1`` skips the cold autotuning. Rank 0 logs each path.

Writes JSON (machine, versions, dtype, the layer's shape; per cp and path: syncs in forward and
backward, collectives) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time

import torch

from gdn_cp.patch import ensure_patched
from gdn_cp_testing.inputs import hidden_inputs
from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, stock_forward, thd_params
from gdn_cp_testing.packings import thd_case, zigzag_rows
from gdn_cp_testing.probes import count_syncs, env_setting
from gdn_cp_testing.ranks import RankPool

from .common import add_out_arguments, machine_info, resolve_out, versions, write_json

logger = logging.getLogger("benchmarks.syncs")

# Shape small enough to compile fast; sync counts do not depend on it.
CFG = dict(deterministic_mode=False, hidden_size=128, linear_num_key_heads=4, linear_num_value_heads=8,
           linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)


def _rank_syncs(ctx, cp_sizes, backend: str = "auto"):
    from gdn_cp.megatron.call import ROUTE_CACHE_ATTR

    rank_groups()  # every rank creates every group, in the same order, before any rank goes on
    if ctx.rank == 0 and not logging.getLogger().handlers:  # a rank process: its progress into the run's log
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = {}
    for cp in cp_sizes:
        if ctx.rank >= cp:  # a CP=1 baseline runs on rank 0 alone
            continue
        group = rank_groups()["world"] if cp == ctx.world_size else rank_groups()["self"]
        padded, actual = thd_case(cp)
        rows = zigzag_rows(padded, cp, ctx.rank).to(ctx.device)
        dims = dict(linear_key_head_dim=128, linear_value_head_dim=128) if backend == "flashqla" else {}  # FlashQLA's only
        fields = dict(CFG, linear_cp_backend=backend, **dims)
        x, dout = hidden_inputs(padded[-1], 1, torch.bfloat16, 5, fields["hidden_size"], ctx.device)
        x, dout = x[rows], dout[rows]
        res = {}
        for path in ("headwise", "chunkwise", "chunkwise generic", "all_gather", "stock headwise"):
            start = time.monotonic()
            mode = {"stock headwise": "headwise", "chunkwise generic": "chunkwise"}.get(path, path)
            # gdn-cp's own chunkwise exchange (async summary gather on NCCL), else the auto path
            setting = env_setting("GDN_CP_CHUNKWISE_PATH", "generic" if path == "chunkwise generic" else None)
            # the rows are cut per document (zigzag_rows): the layer is told so
            cfg = make_config(cp, mode, torch.bfloat16, linear_cp_thd_split="per_document", **fields)
            first = build_gdn(cfg, group, seed=1, layer_number=1, device=ctx.device)
            second = build_gdn(cfg, group, seed=2, layer_number=2, device=ctx.device)
            params = thd_params(padded, actual, device=ctx.device)

            def call(layer):
                xi = x.detach().clone().requires_grad_(True)
                o, _ = layer(xi, None, packed_seq_params=params)
                return o

            ctxm = stock_forward() if path == "stock headwise" else contextlib.nullcontext()
            with ctxm, setting:
                call(first).backward(dout)  # builds routes / FLA context, autotunes
                before = ctx.collective_count()
                o, fwd = count_syncs(lambda: call(second))
                _, bwd = count_syncs(lambda: o.backward(dout))
            cache = getattr(params, ROUTE_CACHE_ATTR, None)
            res[path] = {
                "forward": len(fwd), "backward": len(bwd),
                "collectives": ctx.collective_count() - before,
                "route_cache": None if cache is None else {"hits": cache.hits, "misses": cache.misses},
            }
            if ctx.rank == 0:
                logger.info("cp=%d %s: %d / %d syncs (forward / backward) in %.0f s", cp, path, len(fwd), len(bwd),
                            time.monotonic() - start)
        out[cp] = res
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="CP sizes (default 1 2)")
    add_out_arguments(parser, "syncs.json")
    parser.add_argument("--backend", choices=("auto", "fla", "flashqla"), default="auto",
                        help="gdn-cp's per-rank kernels (linear_cp_backend; flashqla at head dims 128)")
    args = parser.parse_args(argv)
    args.out = str(resolve_out(args, "syncs.json"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"benchmarks.syncs: error: needs a CUDA GPU (it counts CUDA device->host synchronizations) and "
              f"torch {torch.__version__} sees none; nothing was measured. Run it on a GPU machine with FLA and "
              "megatron-core 0.19.2 (benchmarks/gpu_suite.sh, stage syncs)", file=sys.stderr)
        return 2

    ensure_patched()  # the installed megatron-core: patched in place if pristine, refused if modified
    world = max(args.cp)
    pool = RankPool(world, device="cuda")
    try:
        per_rank = pool.run(_rank_syncs, args.cp, args.backend)
    finally:
        pool.close()
    result = {"machine": machine_info(), "versions": versions(), "dtype": "bfloat16", "config": CFG,
              "linear_cp_backend": args.backend, "cp": {}}
    print(f"{'cp':>3} {'path':<15} {'fwd syncs':>9} {'bwd syncs':>9} {'collectives':>11}  (max over ranks)")
    for cp in args.cp:
        ranks = [r[cp] for r in per_rank if cp in r]
        summary = {}
        for path in ranks[0]:
            summary[path] = {k: max(r[path][k] for r in ranks) for k in ("forward", "backward", "collectives")}
            summary[path]["route_cache_rank0"] = ranks[0][path]["route_cache"]
            s = summary[path]
            print(f"{cp:>3} {path:<15} {s['forward']:>9} {s['backward']:>9} {s['collectives']:>11}")
        result["cp"][str(cp)] = summary
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
