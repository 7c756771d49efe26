"""``gdn-cp run``: the command line of the main job (:mod:`gdn_cp.cli.main_job`).

Every flag is checked by argparse (the error names the flag), and the flags together (a mode named in
``--modes`` that cannot split the heads at a ``--cp`` size) before torch is imported; what depends on the
machine (CUDA, NCCL, FLA, memory) and what every rank would refuse (the chunkwise path setting, FLA's head
dims) is checked by :func:`gdn_cp.cli.main_job.check_job` before any rank is spawned. Lists are
comma-separated for every flag that takes one (``--cp 2,4 --modes headwise,chunkwise``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .. import env
from .args import comma_items, int_list, int_range
from .job_modes import named_modes_problem
from .output import CommandError, exit_epilog, print_warning
from ..modes.spec import MODE_NAMES
from ..ops.registry import BACKEND_NAMES

__all__ = ["add_run_command"]


POOL_BACKEND_ENV = "GDN_CP_TEST_DIST_BACKEND"

MAX_RANKS = 64
"""Most ranks ``gdn-cp run`` spawns on one machine (each is a process)."""
MAX_SEQUENCES = 1 << 16
MAX_TOKENS_PER_RANK = 1 << 20
MAX_HEADS = 256
MAX_HEAD_DIM = 512
MAX_SEED = 2**63 - 1

cp_sizes = int_list(1, unique=True)
cp_sizes.__doc__ = "``--cp``: comma-separated CP sizes, each an integer >= 1."


def _cp_sizes(text: str) -> tuple[int, ...]:
    sizes = cp_sizes(text)
    too_many = [c for c in sizes if c > MAX_RANKS]
    if too_many:
        raise argparse.ArgumentTypeError(f"CP size {too_many[0]} would spawn more than {MAX_RANKS} ranks on this "
                                         "machine; use e.g. --cp 2,4")
    return tuple(sizes)


def mode_names(text: str) -> tuple[str, ...]:
    """``--modes``: comma-separated mode names from the registry."""
    items = comma_items(text, unique=True)
    unknown = [m for m in items if m not in MODE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown)}; use a comma-separated list of "
                                         f"{', '.join(MODE_NAMES)}")
    return tuple(items)


def head_counts(text: str) -> tuple[int, int]:
    """``--heads K,V``: key and value heads, V a multiple of K (value head h reads key head h // (V/K))."""
    k, v = int_list(1, count=2)(text)
    if max(k, v) > MAX_HEADS:
        raise argparse.ArgumentTypeError(f"at most {MAX_HEADS} heads, got {text!r}")
    if v % k:
        raise argparse.ArgumentTypeError(f"the value heads ({v}) must be a multiple of the key heads ({k}): value "
                                         f"head h reads key head h // (V/K); e.g. {k},{2 * k}")
    return k, v


def even_tokens(text: str) -> int:
    value = int_range(1, MAX_TOKENS_PER_RANK)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"{value} must be even (T_global = tokens per rank * cp is cut into "
                                         "2*cp zigzag parts)")
    return value


def add_run_command(sub, parents=()) -> None:
    """Add ``run`` to the ``gdn-cp`` subcommands (``parents``: the flags every command takes)."""
    p = sub.add_parser(
        "run", parents=list(parents), help="the main job: a real CP run of the GDN core, checked against CP=1",
        description="Spawn cp ranks (CPU gloo by default; NCCL + FLA when there are enough GPUs), round-trip the "
        "routes of a packed micro-batch, then run each mode forward+backward and print, per mode, the relative "
        "errors of the output and of every gradient against CP=1 on the same inputs, each line as soon as the "
        "ranks are done with it (on a terminal, a progress bar on stderr counts the steps of a run that takes "
        "more than a few seconds). Without --modes, a mode that cannot run at a CP size (headwise when the heads "
        "do not divide it) is skipped and listed; a mode named in --modes must run at every --cp size (checked "
        "before anything is spawned). -v also prints every rank's log (its THD cut, route, mode, backend and "
        "chunkwise exchange path); -q prints only the failures and the verdict. A GDN_CP_* variable that nothing "
        "reads gets one warning (gdn-cp doctor says who reads each).",
        epilog=exit_epilog("a check failed (a relative error over the tolerance, a round trip that is not "
                           "bit-exact, a rank that failed)"))
    p.add_argument("--cp", type=_cp_sizes, default=(2, 4), metavar="LIST",
                   help=f"comma-separated CP sizes in [1, {MAX_RANKS}], e.g. 2,4 (default 2,4)")
    p.add_argument("--modes", type=mode_names, default=None, metavar="LIST",
                   help=f"comma-separated modes, from {','.join(MODE_NAMES)} (default: all, each skipped and listed "
                   "where it cannot run; a mode named here must run at every --cp size, else exit 2 before "
                   "anything is spawned)")
    p.add_argument("--sequences", type=int_range(1, MAX_SEQUENCES), default=37,
                   help=f"packed sequences per micro-batch, in [1, {MAX_SEQUENCES}] (default 37)")
    p.add_argument("--tokens-per-rank", type=even_tokens, default=1024,
                   help=f"T_global / cp, an even number in [2, {MAX_TOKENS_PER_RANK}] (default 1024). On the CPU every "
                   "rank also computes CP=1 on all T_global tokens, so time and memory grow with T_global: a run that "
                   "would not fit in the available memory is refused before it starts, with the estimate")
    p.add_argument("--heads", type=head_counts, default=(4, 8), metavar="K,V",
                   help=f"key and value heads of the GDN core, V a multiple of K, at most {MAX_HEADS} (default 4,8)")
    p.add_argument("--head-dim", type=int_range(1, MAX_HEAD_DIM), default=32,
                   help=f"key and value head dim, in [1, {MAX_HEAD_DIM}] (default 32)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="dtype of the activations (the log decay g stays fp32, fp64 with float64; default float32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when torch sees a GPU")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=None,
                   help="math backend (default: fla on CUDA when it imports, else reference)")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with a GPU per rank, else gloo")
    p.add_argument("--seed", type=int_range(0, MAX_SEED), default=0,
                   help="seed of the packing (sequence lengths) and of the inputs, the same on every rank and CP size "
                   "(default 0)")
    p.add_argument("--json", action="store_true",
                   help="print the run as one JSON object at the end (config, tolerance, one row per (cp, mode) with "
                   "its errors and seconds, skipped, failures, verdict) instead of the report lines")
    p.set_defaults(func=run_command)


def run_command(args) -> int:
    k, v = args.heads
    problem = named_modes_problem(args.modes, tuple(args.cp), k, v)
    if problem:  # said before torch is imported (seconds on a busy machine)
        raise CommandError(problem)
    from ..modes import GDNShape
    from .main_job import auto_config, run_job
    from .progress import Progress

    overrides = {
        "cp_sizes": tuple(args.cp),
        "modes": args.modes,
        "num_sequences": args.sequences,
        "tokens_per_rank": args.tokens_per_rank,
        "shape": GDNShape(num_k_heads=k, num_v_heads=v, head_k_dim=args.head_dim, head_v_dim=args.head_dim),
        "dtype": args.dtype,
        "seed": args.seed,
    }
    for name in ("device", "backend", "dist_backend"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    cfg = auto_config(**overrides)
    _warn_about_the_environment(cfg.dist_backend)
    quiet, as_json = getattr(args, "quiet", False), args.json
    echo = (lambda line: None) if as_json else (lambda line: print(line, flush=True))
    from ..ops.registry import BACKENDS, backend_spec

    first_use = backend_spec(cfg.backend).first_use() if cfg.backend in BACKENDS else ""
    if first_use and not quiet:  # minutes of silence otherwise (issue 46: 170 s with nothing printed)
        echo(f"gdn-cp run: {first_use}")
    try:
        with Progress(echo, bar=None if not quiet else False, unit="step") as progress:
            result = run_job(cfg, echo=echo, verdict_only=quiet, progress=progress,
                             rank_log_level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING)
    except ValueError as err:  # the job cannot run on this machine: said before anything was spawned
        raise CommandError(str(err)) from None
    except KeyboardInterrupt:
        print("\ngdn-cp run: interrupted; the ranks were stopped", file=sys.stderr)
        return 130
    if as_json:
        print(json.dumps(result.to_json(cfg), indent=2))
    return result.exit_code


def _warn_about_the_environment(dist_backend: str) -> None:
    """One line on stderr for ``GDN_CP_*`` variables nothing reads (a guessed name, e.g. GDN_CP_PG_TIMEOUT),
    and one for the tests' pool backend variable, which a user may take for this run's."""
    unread = env.unread_names()
    if unread:
        print_warning("gdn-cp run", f"nothing reads {', '.join(unread)} (neither a gdn-cp setting, `python3 -m "
                      "gdn_cp.env`, nor a name of a clone's tests or benchmarks); this run takes its settings from its "
                      "flags (gdn-cp run --help): unset " + ("it" if len(unread) == 1 else "them"))
    pool_backend = os.environ.get(POOL_BACKEND_ENV, "")  # the tests' setting (gdn_cp_testing.env), not gdn-cp's
    if pool_backend and pool_backend != dist_backend:  # issue #32: was ignored without a word
        print(f"gdn-cp run: note: {POOL_BACKEND_ENV}={pool_backend} chooses the backend of the test rank pools; "
              f"gdn-cp run takes --dist-backend (this run: {dist_backend})", file=sys.stderr, flush=True)
