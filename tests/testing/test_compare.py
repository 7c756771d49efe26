"""gdn_cp_testing.compare: the comparisons the end-to-end and GPU tests share."""

import math

import pytest
import torch

from gdn_cp_testing.compare import gather_rows, max_rel_seq, rel_err, training_diff


def test_relative_error_is_over_the_reference():
    assert rel_err(1.1, 1.0) == pytest.approx(0.1)
    assert rel_err(1.0, 1.1) == pytest.approx(0.1 / 1.1)  # the second argument is the reference
    assert rel_err(0.0, 0.0) == 0.0 and rel_err(1e-30, 0.0) == math.inf
    assert max_rel_seq([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="2 values against 3"):  # zip would have compared two steps only
        max_rel_seq([1.0, 2.0], [1.0, 2.0, 3.0])


def _run(params, loss=(2.0, 1.5), norm=(1.0, 0.9)):
    return {"loss": list(loss), "grad_norm": list(norm), "params": params}


def test_training_diff_compares_losses_norms_parameters_and_names():
    a, b = torch.ones(3, dtype=torch.float64), torch.full((2,), 2.0, dtype=torch.float64)
    ref = _run({"a": a, "b": b})
    same = training_diff(_run({"a": a.clone(), "b": b.clone()}), ref)
    assert same == {"loss": 0.0, "grad_norm": 0.0, "params": 0.0, "names_ok": True}
    off = training_diff(_run({"a": a * 1.01, "b": b}, loss=(2.0, 1.8), norm=(1.0, 0.99)), ref)
    assert off["loss"] == pytest.approx(0.2) and off["grad_norm"] == pytest.approx(0.1)
    assert off["params"] == pytest.approx(0.01)
    # a parameter missing: not the reference's names, unless the run holds part of the model (a stage)
    assert not training_diff(_run({"a": a}), ref)["names_ok"]
    assert training_diff(_run({"a": a}), ref, part=True)["names_ok"]
    extra = training_diff(_run({"a": a, "b": b, "c": b}), ref, part=True)
    assert not extra["names_ok"] and extra["params"] == math.inf


def test_gather_rows_puts_each_ranks_rows_back_and_sums_the_replicated_gradients():
    full = torch.arange(8.0).reshape(8, 1)
    ranks = []
    for rows in (torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])):  # a zigzag split over 2 ranks
        part = {k: full[rows] * s for k, s in (("o", 1), ("dqkv", 2), ("dg", 3), ("dbeta", 4))}
        ranks.append({"case": {"rows": rows, **part, "dw": torch.ones(2), "db": torch.ones(1)}})
    got = gather_rows(ranks, "case", 2, 0, 8)
    assert torch.equal(got["o"], full) and torch.equal(got["dbeta"], full * 4)
    assert torch.equal(got["dw"], torch.full((2,), 2.0, dtype=torch.float64)) and got["db"].item() == 2.0
