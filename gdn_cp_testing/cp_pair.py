"""Run one training script at CP=1 (``python3 SCRIPT``) and at CP=2 (``torchrun --nproc-per-node 2 SCRIPT``)
side by side, as a user would, and write what each printed as JSON (``--out``): ``{"1": {"returncode",
"stdout", "stderr"}, "2": {...}, "torchrun_logs": [files]}``. The tests start it in the background when the
session starts (tests/conftest.py, ``SMOKE_RUNS``): four Pythons that import megatron-core, ~15 s on 2 cores.

``--script PATH`` runs that file; ``--docs-recipe`` the first ``python`` block of docs/megatron.md's section on
a GDN model without TransformerEngine (written into the work folder). Every process runs in a fresh work
folder (``--work``, default a temp folder) with ``TMPDIR`` there, ``OMP_NUM_THREADS=1`` and free ports."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_SECTION = "## A GDN model without TransformerEngine (local modules)"


def docs_recipe() -> str:
    """The first ```python block of docs/megatron.md's recipe section."""
    text = (REPO / "docs" / "megatron.md").read_text()
    section = text[text.index(RECIPE_SECTION):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(script: Path, work: Path, timeout_s: float, pythonpath: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), TMPDIR=str(work))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    logs = work / "torchrun"  # torchrun's log folder (else a torchelastic_* folder left in the temp dir)
    commands = {1: [sys.executable, str(script)],
                2: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(free_port()), "--log-dir", str(logs), str(script)]}
    runs = {cp: subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cp, cmd in commands.items()}
    out = {}
    for cp, run in runs.items():
        stdout, stderr = run.communicate(timeout=timeout_s)
        out[str(cp)] = {"returncode": run.returncode, "stdout": stdout, "stderr": stderr}
    out["torchrun_logs"] = sorted(str(p.relative_to(logs)) for p in logs.rglob("*")) if logs.is_dir() else []
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--script", type=Path)
    which.add_argument("--docs-recipe", action="store_true")
    p.add_argument("--work", type=Path)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gdn_cp_pair_", dir=args.out.parent))
    work.mkdir(parents=True, exist_ok=True)
    script = args.script
    if args.docs_recipe:
        script = work / "recipe.py"
        script.write_text(docs_recipe())
    args.out.write_text(json.dumps(run_pair(script.resolve(), work, args.timeout, pythonpath=args.docs_recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
