"""docs/megatron.md's model recipe runs as written on a CPU (issue #32: the prose recipe failed with
Megatron's own errors until deterministic_mode and perform_initialization were found), at CP=1 and,
under torchrun, at CP=2, where it prints CP=1's loss."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTION = "## A GDN model without TransformerEngine (local modules)"


def docs_recipe() -> str:
    """The first ```python block of the section."""
    text = (REPO / "docs" / "megatron.md").read_text()
    section = text[text.index(SECTION):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.megatron
@pytest.mark.slow
def test_the_docs_model_recipe_runs_as_written_on_a_cpu(patched_megatron, tmp_path):
    script = tmp_path / "recipe.py"
    script.write_text(docs_recipe())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()),
               TMPDIR=str(tmp_path))  # anything else a process puts in the temp dir: under this test's folder too
    logs = tmp_path / "torchrun"  # torchrun's log folder (else a torchelastic_* folder left in the temp dir)
    commands = {1: [sys.executable, str(script)],
                2: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(_free_port()), "--log-dir", str(logs), str(script)]}
    runs = {cp: subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cp, cmd in commands.items()}
    losses, stderr = {}, {}
    for cp, run in runs.items():
        out, stderr[cp] = run.communicate(timeout=300)
        err = stderr[cp]
        assert run.returncode == 0, (cp, out[-2000:], err[-4000:])
        (loss,) = re.findall(rf"^CP={cp}: mean loss ([0-9.]+)$", out, re.M)
        losses[cp] = float(loss)
        assert "requested=auto resolved=chunkwise" in err, err[-3000:]  # the default mode, logged
    assert 0 < losses[1] < 10 and abs(losses[2] - losses[1]) <= 1e-5, losses
    assert "GatedDeltaNet layer 1 runs linear_cp_mode=chunkwise (TP=1, CP=2" in stderr[2]
    assert logs.is_dir() and any(logs.iterdir()), "torchrun wrote no log folder under the test's own"
