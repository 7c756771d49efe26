"""Run 2026-12-07j's probe, kept with its records (halo_profile.txt; cut at its 120 s limit after the 16K rows): the
conv's backward per form with and without a halo, host time per backward against the kernels' (torch.profiler)."""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.glue_kernels import _inputs
from gdn_cp.ops.fused import triton_conv

FORMS = {"scan": {"scan": True}, "scan_few": {"scan": True, "few_launches": True}}  # scan_few: removed since
out = {}
for rows in (16384, 65536):
    for halo_on in (False, True):
        for form_name, form in FORMS.items():
            x, weight, bias, positions, douts = _inputs(rows, 16, 32, 128, "cuda", torch.bfloat16)
            halo = torch.randn(3, x.shape[1], device="cuda").to(torch.bfloat16) if halo_on else None
            leaves = [x.detach().requires_grad_(True), weight.requires_grad_(True)] + (
                [halo.requires_grad_(True)] if halo_on else [])

            def fwd():
                return triton_conv.conv_silu_split_triton(leaves[0], leaves[1], None, positions, halo, 16, 32, 128,
                                                          128, True, 1e-6, **form)
            for _ in range(3):
                torch.autograd.grad(fwd(), leaves, douts)
            torch.cuda.synchronize()
            n = 10
            outs = [fwd() for _ in range(n)]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for o in outs:
                    torch.autograd.grad(o, leaves, douts)
                host_ms = (time.perf_counter() - t0) * 1e3 / n
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t0) * 1e3 / n
            kernels = {e.key[:80]: round(e.self_device_time_total / 1e3 / n, 4) for e in prof.key_averages()
                       if e.device_type.name == "CUDA"}
            key = f"{rows} halo={halo_on} {form_name}"
            out[key] = {"host_ms_per_bwd": round(host_ms, 3), "wall_ms_per_bwd": round(wall_ms, 3),
                        "gpu_ms_per_bwd": round(sum(kernels.values()), 4), "kernels": kernels}
            print(key, json.dumps(out[key]), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
