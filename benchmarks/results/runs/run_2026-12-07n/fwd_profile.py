"""Run 2026-12-07n's probe, kept with its records: the conv forward's GPU kernel time with and without a halo, from
the gdn_cp that the import finds (the main tree: fwd_main_*.json; the tree with the halo's own launch, run from a
copy of it as the script's folder: fwd_halo_first_rows.json)."""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.glue_kernels import _inputs
from gdn_cp.ops.fused import triton_conv

out = {}
for rows in (16384, 65536):
    for halo_on in (False, True):
        x, weight, bias, positions, douts = _inputs(rows, 16, 32, 128, "cuda", torch.bfloat16)
        halo = torch.randn(3, x.shape[1], device="cuda").to(torch.bfloat16) if halo_on else None

        def f():
            return triton_conv.conv_silu_split_triton(x, weight, None, positions, halo, 16, 32, 128, 128, True, 1e-6,
                                                      scan=True)
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
        k = {e.key[:60]: round(e.self_device_time_total / 1e3 / 20, 4) for e in prof.key_averages()
             if e.device_type.name == "CUDA"}
        out[f"{rows} halo={halo_on}"] = {"gpu_ms": round(sum(k.values()), 4), "kernels": k, "tree": triton_conv.__file__}
        print(rows, halo_on, out[f"{rows} halo={halo_on}"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
