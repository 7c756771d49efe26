"""``gdn-cp selftest``: every backend of the registry against the reference backend on the user's own stack.

Small shapes, one process, outputs and gradients, failing loudly with the errors reached. It is
the check that catches a kernel stack that computes the wrong thing, e.g. FLA >= 0.5's GDN
backward on Hopper with Triton < 3.7.1 (FLA issue #640): FLA either refuses (an error is
reported) or the gradients disagree with the reference (a failed tolerance is reported).

What runs comes from the registry (:mod:`gdn_cp.ops.registry`): each backend's ``BackendSpec`` says its
cases (``selftest``: ``conv`` / ``gdn`` in which dtypes, at which head dims), its tolerances against the fp64
reference (``tolerances``), its stack report and its notes (hazards), so this module names no backend but the
oracle. ``run_selftest(gpu=False)`` checks the backends that run on the CPU (the reference, fp32 against
itself in fp64; the others are listed as not checked, with why); ``run_selftest(gpu=True)`` checks every
CUDA backend that runs here (FLA's kernels in fp32 and bf16, FlashQLA's in bf16) against the reference in
fp64; a backend offering a fused gated norm has it checked too and, where TransformerEngine imports, with
the weight and eps gdn-cp reads from TE's RMSNorm against TE's own norm * silu(z) (else the report lists it
as not checked, and why). ``gdn-cp selftest`` runs the GPU check where torch sees a GPU and a CUDA backend
runs, else the CPU one; ``--gpu`` insists on the GPU check (exit 2, before anything runs, where it cannot).

The case builders here are shared with ``tests/gpu``; the error metrics come from :mod:`gdn_cp.ops.accuracy`,
the version report from :mod:`gdn_cp.ops.versions`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..ops.accuracy import max_rel, rel_l2, worst
from ..ops.versions import stack_versions

__all__ = [
    "CaseResult",
    "SelftestReport",
    "conv_case",
    "gdn_case",
    "run_selftest",
]

# The small case: packed THD with an empty sequence and a sequence starting at row 0 fed by a halo.
SELFTEST_CU = [0, 37, 37, 130, 301]
SELFTEST_DIMS = dict(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, conv_kernel_size=4)


@dataclass
class CaseResult:
    name: str
    ok: bool
    tolerance: float | None = None
    errors: dict[str, float] = field(default_factory=dict)  # rel L2 per tensor
    max_errors: dict[str, float] = field(default_factory=dict)  # max-abs / max-ref per tensor
    seconds: float = 0.0
    error: str | None = None

    def line(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        if self.error is not None:
            return f"{status} {self.name}: {self.error.strip().splitlines()[-1]}"
        name, err = worst(self.errors)
        return (f"{status} {self.name}: worst rel-L2 {err:.2e} ({name}), tolerance "
                f"{self.tolerance:.0e} ({self.seconds:.1f}s)")


_WHAT = ("causal conv and gated delta rule with packed sequences, a halo and initial states; outputs and "
         "gradients")


def _label(spec) -> str:
    """How the report names a backend: ``the FLA backend``, ``the reference backend``."""
    return spec.title if spec.title.startswith("the ") else f"the {spec.title} backend"


def _dtypes(spec) -> str:
    return ", ".join(dict.fromkeys(c.dtype for c in spec.selftest))


def checked(gpu: bool) -> str:
    """What a run checks, from the registry: each backend's selftest cases (its spec's ``selftest``)."""
    from ..ops.registry import BACKENDS, ORACLE

    if not gpu:
        runs = [s for s in BACKENDS.values() if "cpu" in s.devices and s.selftest]
        return "; ".join(f"{_label(s)} ({s.devices_why}) in {_dtypes(s)} against "
                         f"{'itself' if s.name == ORACLE else 'the reference backend'} in float64 on the CPU"
                         for s in runs) + f": {_WHAT}"
    runs = [s for s in BACKENDS.values() if s.name != ORACLE and "cuda" in s.devices and s.selftest]
    return (", ".join(f"{_label(s)} ({_dtypes(s)})" for s in runs) + f" against the reference backend in float64 "
            f"on the GPU, each where it runs: {_WHAT}; a backend's fused gated norm, also against TransformerEngine's "
            "RMSNorm (with and without zero_centered_gamma) where TE imports")


NOT_CHECKED_ANYWHERE = "context parallelism (CP > 1 against CP=1: `gdn-cp run`)"


def gpu_unavailable_reason() -> str | None:
    """Why the GPU check cannot run here (no CUDA GPU, no CUDA backend of the registry runs), or None when it can."""
    from ..ops.registry import BACKENDS, ORACLE

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    whys = [f"{_label(s)}: {why}" for s in BACKENDS.values()
            if s.name != ORACLE and "cuda" in s.devices and s.selftest and (why := s.problem()) is not None]
    runs = [s for s in BACKENDS.values() if s.name != ORACLE and "cuda" in s.devices and s.selftest]
    return "; ".join(whys) if len(whys) == len(runs) else None


@dataclass
class SelftestReport:
    ok: bool
    gpu: bool
    versions: dict[str, Any]
    cases: list[CaseResult]
    notes: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)  # what this run did not check, each with why
    stack: dict[str, Any] = field(default_factory=dict)  # GPU: each backend's stack_report(), by name

    @property
    def checked(self) -> str:
        return checked(self.gpu)

    def __str__(self) -> str:
        return self.text()

    def text(self, *, verbose: bool = False, quiet: bool = False) -> str:
        """The report; ``verbose`` (``-v``): every tensor's error of every check, not only of the failed ones;
        ``quiet`` (``-q``): only the verdict, the failed checks (with their tensors' errors) and the notes."""
        if quiet:
            lines = [f"gdn-cp selftest: {'OK' if self.ok else 'FAILED'}"]
            for c in self.cases:
                if not c.ok:
                    lines += ["  " + c.line(), *self._tensor_lines(c)]
            return "\n".join(lines + ["  note: " + n for n in self.notes])
        lines = [f"gdn-cp selftest: {'OK' if self.ok else 'FAILED'}", f"  checked: {self.checked}"]
        for stack in self.stack.values():
            lines.append(f"  stack checked: {stack['stack']}")
            for name, text in stack.get("choices", {}).items():
                lines.append(f"    {name}: {text}")
        lines += [f"  not checked: {n}" for n in self.not_checked + [NOT_CHECKED_ANYWHERE]]
        lines.append("  versions: " + ", ".join(f"{k}={v}" for k, v in self.versions.items()))
        for c in self.cases:
            lines.append("  " + c.line())
            if verbose or not c.ok:
                lines += self._tensor_lines(c)
        for n in self.notes:
            lines.append("  note: " + n)
        return "\n".join(lines)

    @staticmethod
    def _tensor_lines(c: CaseResult) -> list[str]:
        lines = []
        for k, e in sorted(c.errors.items()):
            flag = "" if c.tolerance is None or e <= c.tolerance else "  <-- over tolerance"
            lines.append(f"      {k}: rel-L2 {e:.3e}, max-rel {c.max_errors.get(k, float('nan')):.3e}{flag}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "gpu": self.gpu, "checked": self.checked,
            "not_checked": self.not_checked + [NOT_CHECKED_ANYWHERE], "versions": self.versions,
            "notes": self.notes, "stack": self.stack, "cases": [c.__dict__ for c in self.cases],
        }

    def raise_if_failed(self) -> "SelftestReport":
        if not self.ok:
            raise RuntimeError(str(self))
        return self


# --------------------------------------------------------------------------------------------
# cases: each returns {name: (candidate, reference)} for outputs and gradients
# --------------------------------------------------------------------------------------------

def _leaf(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).detach().requires_grad_(True)


def conv_case(backend, reference, *, dtype: torch.dtype, device, seed: int = 0,
              cu: list[int] | None = None, channels: int | None = None, conv_kernel_size: int = 4,
              ref_device=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """causal_conv1d with a halo and an empty sequence; candidate in ``dtype`` vs reference in fp64."""
    cu = list(cu or SELFTEST_CU)
    d = SELFTEST_DIMS
    C = channels or (2 * d["num_k_heads"] * d["head_k_dim"] + d["num_v_heads"] * d["head_v_dim"])
    W, T = conv_kernel_size, cu[-1]
    gen = torch.Generator().manual_seed(seed)
    master = {
        "x": torch.randn(T, C, generator=gen, dtype=torch.float64),
        "weight": torch.randn(C, W, generator=gen, dtype=torch.float64) * 0.5,
        "bias": torch.randn(C, generator=gen, dtype=torch.float64) * 0.1,
        "halo": torch.randn(W - 1, C, generator=gen, dtype=torch.float64),
    }
    dy = torch.randn(T, C, generator=gen, dtype=torch.float64)
    # round the inputs to the candidate dtype first, so that only the kernel's error is measured
    master = {k: v.to(dtype).to(torch.float64) for k, v in master.items()}
    ref_device = ref_device or device

    cand = {k: _leaf(v, dtype, device) for k, v in master.items()}
    y = backend.causal_conv1d(cand["x"], cand["weight"], cand["bias"], cu_seqlens=cu, halo=cand["halo"],
                              activation="silu")
    (y.double() * dy.to(device)).sum().backward()

    ref = {k: _leaf(v, torch.float64, ref_device) for k, v in master.items()}
    y_ref = reference.causal_conv1d(ref["x"], ref["weight"], ref["bias"], cu_seqlens=cu, halo=ref["halo"],
                                    activation="silu")
    (y_ref * dy.to(ref_device)).sum().backward()

    out = {"y": (y, y_ref)}
    for k in master:
        out[f"d{k}"] = (cand[k].grad, ref[k].grad)
    return out


def gdn_case(backend, reference, *, dtype: torch.dtype, device, seed: int = 0,
             cu: list[int] | None = None, dims: dict | None = None, initial_state: bool = True,
             ref_device=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """chunk_gated_delta_rule with grouped heads, an empty sequence, initial and final states."""
    cu = list(cu or SELFTEST_CU)
    d = dict(SELFTEST_DIMS, **(dims or {}))
    Hk, Hv, Dk, Dv = d["num_k_heads"], d["num_v_heads"], d["head_k_dim"], d["head_v_dim"]
    T, N = cu[-1], len(cu) - 1
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    master = {
        "q": torch.randn(T, Hk, Dk, generator=gen, dtype=f64),
        "k": torch.randn(T, Hk, Dk, generator=gen, dtype=f64),
        "v": torch.randn(T, Hv, Dv, generator=gen, dtype=f64),
        "g": F.logsigmoid(torch.randn(T, Hv, generator=gen, dtype=f64) + 3.0),
        "beta": torch.sigmoid(torch.randn(T, Hv, generator=gen, dtype=f64)),
    }
    if initial_state:
        master["h0"] = torch.randn(N, Hv, Dk, Dv, generator=gen, dtype=f64) * 0.1
    do = torch.randn(T, Hv, Dv, generator=gen, dtype=f64)
    dfs = torch.randn(N, Hv, Dk, Dv, generator=gen, dtype=f64)
    cdtype = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype, "g": torch.float32, "h0": torch.float32}
    master = {k: v.to(cdtype[k]).to(f64) for k, v in master.items()}
    ref_device = ref_device or device

    def run(mod, tensors, dev):
        o, fs = mod.chunk_gated_delta_rule(
            tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"], cu_seqlens=cu,
            initial_state=tensors.get("h0"), output_final_state=True, use_qk_l2norm=True)
        ((o.double() * do.to(dev)).sum() + (fs.double() * dfs.to(dev)).sum()).backward()
        return o, fs

    cand = {k: _leaf(v, cdtype[k], device) for k, v in master.items()}
    o, fs = run(backend, cand, device)
    ref = {k: _leaf(v, f64, ref_device) for k, v in master.items()}
    o_ref, fs_ref = run(reference, ref, ref_device)
    out = {"o": (o, o_ref), "final_state": (fs, fs_ref)}
    for k in master:
        out[f"d{k}"] = (cand[k].grad, ref[k].grad)
    return out


def gated_norm_case(backend, *, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """The backend's fused ``RMSNorm(x) * weight * silu(z)`` against the same in fp64: y, dx, dz, dw."""
    gen = torch.Generator().manual_seed(seed)
    n, d = 300, 64
    x0, z0 = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    w0, dy = 1 + 0.1 * torch.randn(d, generator=gen), torch.randn(n, d, generator=gen)
    got = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (x0, z0, w0)]
    y = backend.fused_gated_rms_norm()(*got, 1e-5)
    y.backward(dy.to(device=device, dtype=dtype))
    ref = [t.detach().double().requires_grad_(True) for t in got]
    x, z, w = ref
    y_ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w * torch.nn.functional.silu(z)
    y_ref.backward(dy.to(device=device, dtype=torch.float64))
    return {"y": (y.detach(), y_ref.detach()),
            **{f"d{k}": (a.grad, b.grad) for k, a, b in zip("xzw", got, ref)}}


def transformer_engine():
    """``(transformer_engine.pytorch, None)``, or ``(None, why not)`` (not installed, does not import)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return None, "TransformerEngine is not installed"
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001 - any import failure: not checked, with the reason
        return None, f"transformer_engine.pytorch does not import ({type(exc).__name__}: {exc})"
    return te, None


def te_gated_norm_case(te, backend, *, zero_centered_gamma: bool, device, seed: int = 0) -> dict:
    """The backend's fused gated norm, with the weight and eps gdn-cp reads from TransformerEngine's
    RMSNorm (``gdn_cp.pins``: ``weight + 1`` for ``zero_centered_gamma``), against TE's own
    norm * silu(z) as Megatron's ``_apply_gated_norm`` computes it; bf16: y, dx, dz, dweight."""
    from ..pins import running_release

    release = running_release()  # how gdn-cp reads TransformerEngine's RMSNorm in the running release
    n, d = 300, 64
    norm = te.RMSNorm(d, eps=1e-5, zero_centered_gamma=zero_centered_gamma, params_dtype=torch.bfloat16,
                      device=device)
    problem = release.fused_rms_norm_problem(norm, d)
    if problem is not None:
        raise RuntimeError(f"gdn-cp does not take this TransformerEngine RMSNorm for the fused norm: {problem}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(d, generator=gen) + (0.0 if zero_centered_gamma else 1.0))
    x0, z0, dy = (torch.randn(n, d, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(3))

    def run(fn):
        norm.weight.grad = None
        x, z = x0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
        y = fn(x, z)
        y.backward(dy)
        return {"y": y.detach(), "dx": x.grad, "dz": z.grad, "dweight": norm.weight.grad.clone()}

    fused = backend.fused_gated_rms_norm()
    got = run(lambda x, z: fused(x, z, release.fused_rms_norm_weight(norm), release.fused_rms_norm_eps(norm)))
    want = run(lambda x, z: (norm(x) * F.silu(z.float())).to(x.dtype))
    return {k: (got[k], want[k]) for k in got}


def compare(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], tolerance: float,
            seconds: float = 0.0) -> CaseResult:
    errors, max_errors = {}, {}
    missing = []
    for k, (a, b) in pairs.items():
        if a is None or b is None:
            missing.append(k)
            continue
        errors[k] = rel_l2(a, b)
        max_errors[k] = max_rel(a, b)
    ok = not missing and all(e <= tolerance for e in errors.values())
    err = f"no gradient reached {missing}" if missing else None
    return CaseResult(name=name, ok=ok, tolerance=tolerance, errors=errors, max_errors=max_errors,
                      seconds=seconds, error=err)


def _run_case(name: str, fn: Callable[[], dict], tolerance: float) -> CaseResult:
    t0 = time.perf_counter()
    try:
        pairs = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the selftest reports every failure
        return CaseResult(name=name, ok=False, tolerance=tolerance, seconds=time.perf_counter() - t0,
                          error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
    return compare(name, pairs, tolerance, time.perf_counter() - t0)


CASES = {"conv": conv_case, "gdn": gdn_case}
"""The case builders a backend's ``SelftestCase`` s name (``kind``)."""


def backend_cases(name: str, cases: list, not_checked: list, seed: int, device: str = "cuda") -> None:
    """Backend ``name``'s selftest cases (its spec's ``selftest``, held to its ``tolerances``) against the
    reference in float64 on ``device``, where it runs here, appended to ``cases``; else it is listed in
    ``not_checked``, with why. On a GPU, a backend that offers a fused gated norm has it checked too (and
    against TransformerEngine's RMSNorm where TE imports)."""
    from ..ops.registry import ORACLE, backend_spec, get_backend

    spec, reference = backend_spec(name), get_backend(ORACLE)
    why = spec.problem() or (None if device in spec.devices else f"it runs on {' or '.join(spec.devices)} only")
    if why is not None:
        not_checked.append(f"{_label(spec)} ({why})")
        return
    backend = get_backend(name)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    suffix = "/cpu" if device == "cpu" else ""
    for case in spec.selftest:
        kwargs = {} if case.head_dims is None else {"dims": dict(head_k_dim=case.head_dims[0], head_v_dim=case.head_dims[1])}
        cases.append(_run_case(
            f"{name}/{case.kind}/{case.dtype}{suffix}",
            lambda case=case, kwargs=kwargs: CASES[case.kind](backend, reference, dtype=getattr(torch, case.dtype),
                                                              device=dev, seed=seed, **kwargs),
            spec.tolerances[case.dtype]))
    if device == "cuda" and backend.fused_gated_rms_norm() is not None:
        tolerance = spec.tolerances["bfloat16"]
        cases.append(_run_case(f"{name}/gated_norm/bfloat16",
                               lambda: gated_norm_case(backend, dtype=torch.bfloat16, device=dev, seed=seed), tolerance))
        te, why_not = transformer_engine()
        if te is None:
            not_checked.append(f"{_label(spec)}'s fused gated norm against TransformerEngine's RMSNorm ({why_not})")
        for zcg in (False, True) if te is not None else ():
            cases.append(_run_case(
                f"{name}/te/gated_norm/bfloat16{'/zero_centered_gamma' if zcg else ''}",
                lambda zcg=zcg: te_gated_norm_case(te, backend, zero_centered_gamma=zcg, device=dev, seed=seed),
                tolerance))


def run_selftest(gpu: bool = True, *, seed: int = 0) -> SelftestReport:
    """Run the backend checks; returns a report (``report.ok``; ``str(report)`` says what failed).

    Every backend of the registry (:mod:`gdn_cp.ops.registry`) with selftest cases is checked where it runs:
    ``gpu=False``: those that run on the CPU (the reference: float32 against itself in float64), the others
    listed as not checked, with why; ``gpu=True``: every CUDA backend but the reference, against it in float64
    (a failed case where torch sees no CUDA GPU)."""
    from ..ops.registry import BACKENDS, ORACLE

    versions = stack_versions()
    cases: list[CaseResult] = []
    not_checked: list[str] = []
    if not gpu:
        for name, spec in BACKENDS.items():
            if spec.selftest and "cpu" in spec.devices:
                backend_cases(name, cases, not_checked, seed, device="cpu")
            elif spec.selftest:
                why = gpu_unavailable_reason() or "asked for the CPU check"
                not_checked.append(f"{_label(spec)} ({why}): `gdn-cp selftest --gpu` checks it where torch sees a "
                                   f"CUDA GPU and {spec.title} runs")
        return SelftestReport(ok=all(c.ok for c in cases), gpu=False, versions=versions, cases=cases,
                              not_checked=not_checked)
    notes = [note for spec in BACKENDS.values() for note in spec.selftest_notes(versions)]
    if not torch.cuda.is_available():
        cases.append(CaseResult(name="cuda", ok=False, error=f"CUDA is not available to torch {torch.__version__}; "
                                "the GPU check needs a CUDA GPU"))
    else:
        for name, spec in BACKENDS.items():
            if name != ORACLE and spec.selftest and "cuda" in spec.devices:
                backend_cases(name, cases, not_checked, seed)
    stack = {}
    if torch.cuda.is_available():
        stack = {name: spec.stack_report() for name, spec in BACKENDS.items()
                 if spec.stack_report is not None and spec.problem() is None}
    return SelftestReport(ok=bool(cases) and all(c.ok for c in cases), gpu=True, versions=versions, cases=cases,
                          notes=notes, not_checked=not_checked, stack=stack)


def run_selftest_command(args) -> int:
    import json

    from .output import CommandError

    why = gpu_unavailable_reason()
    if args.gpu and why is not None:
        raise CommandError(f"--gpu: the GPU check cannot run here: {why}; run `gdn-cp selftest` (without --gpu) "
                           "for the CPU check")
    rep = run_selftest(gpu=why is None)
    print(json.dumps(rep.to_dict(), indent=2, default=str) if args.json else
          rep.text(verbose=getattr(args, "verbose", False), quiet=getattr(args, "quiet", False)))
    return 0 if rep.ok else 1
