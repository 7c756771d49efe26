"""docs/megatron.md's model recipe runs as written on a CPU (issue #32: the prose recipe failed with
Megatron's own errors until deterministic_mode and perform_initialization were found), at CP=1 and,
under torchrun, at CP=2, where it prints CP=1's loss (the runs: gdn_cp_testing.cp_pair --docs-recipe)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import start_smoke_run

# the CP=1 and CP=2 runs start in the background when the session starts (tests/conftest.py queues the runs
# a selected test names as a fixture), unless the session may patch the installed megatron-core while it runs
SMOKE_RUNS = {"recipe_runs": ("gdn_cp_testing.cp_pair", ["--docs-recipe", "--timeout", "300"])}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def recipe_runs(patched_megatron):
    return start_smoke_run(sys.modules[__name__], "recipe_runs").result(timeout_s=900)


@pytest.mark.megatron
@pytest.mark.slow
def test_the_docs_model_recipe_runs_as_written_on_a_cpu(recipe_runs):
    code, printed, out = recipe_runs
    assert code == 0, printed[-3000:]
    runs = json.loads(out.read_text())
    losses, stderr = {}, {}
    for cp in (1, 2):
        run = runs[str(cp)]
        err = stderr[cp] = run["stderr"]
        assert run["returncode"] == 0, (cp, run["stdout"][-2000:], err[-4000:])
        (loss,) = re.findall(rf"^CP={cp}: mean loss ([0-9.]+)$", run["stdout"], re.M)
        losses[cp] = float(loss)
        assert "requested=auto resolved=chunkwise" in err, err[-3000:]  # the default mode, logged
    assert 0 < losses[1] < 10 and abs(losses[2] - losses[1]) <= 1e-5, losses
    assert "GatedDeltaNet layer 1 runs linear_cp_mode=chunkwise (TP=1, CP=2" in stderr[2]
    assert runs["torchrun_logs"], "torchrun wrote no log folder under the run's own"
