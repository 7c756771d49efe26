"""The padded per-document cut of ``--dataloader-inter-document-masking`` rows at CP > 1
(:mod:`gdn_cp.megatron.document_padding`), checked against an independent per-token model of it.

The model (:func:`padded_cut_model`) walks every position of every padded document and says which
rank holds it, in which order, and whether it is a real token (which one) or a pad; from it the
expected batch of every rank follows (tokens, labels, loss mask, position ids of the real rows; 0
and loss mask 0 at the pads; the logical and padded boundaries; the longest padded document). It is
compared with :func:`pad_and_cut` over many rows in this process, and with Megatron's own
``get_batch_on_this_cp_rank`` (patched) on CP groups of 2 and 4 gloo ranks, where Megatron-LM's
args ask for the cut as the patched ``validate_args`` leaves them. The models fed by this cut equal
CP=1 in ``test_e2e_models.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gdn_cp.layout import PER_DOCUMENT
from gdn_cp_testing.megatron.batches import packed_batch, random_lengths

VOCAB = 64


# ------------------------------------------------------------------------------------------
# the independent model: token by token
# ------------------------------------------------------------------------------------------
def padded_cut_model(docs: list[int], cp: int, rank: int, local_multiple: int = 1) -> tuple[list, list[int]]:
    """``(rows, padded lengths)``: rank ``rank``'s rows in order, each the position of a real token
    in the unpadded row or None for a pad. Every document gets the fewest pads (at its end) that
    make its length a multiple of 2*cp; the last one more until each rank's row count is a multiple
    of ``local_multiple``; each padded document is cut in 2*cp equal parts, part p belonging to rank
    p (p < cp) or 2*cp-1-p, and a rank lists its parts of document 0 (lower part first), then of
    document 1, and so on."""
    padded = [length + (-length) % (2 * cp) for length in docs]
    while (sum(padded) // cp) % local_multiple:
        padded[-1] += 2 * cp
    mine = {}  # (document, part) -> [rows]
    start = 0
    for d, (length, room) in enumerate(zip(docs, padded)):
        part_len = room // (2 * cp)
        for position in range(room):
            part = position // part_len
            owner = part if part < cp else 2 * cp - 1 - part
            if owner == rank:
                mine.setdefault((d, part), []).append(start + position if position < length else None)
        start += length
    rows = [row for key in sorted(mine) for row in mine[key]]
    return rows, padded


def expected_cut(flat: dict, docs: list[int], cp: int, rank: int, local_multiple: int = 1) -> dict:
    """The batch rank ``rank`` must get from the padded cut of ``flat`` (a flattened batch), per the model."""
    rows, padded = padded_cut_model(docs, cp, rank, local_multiple)
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        row = flat[key][0]
        out[key] = [0 if r is None else row[r].item() for r in rows]
    out["cu_seqlens"] = [0] + [sum(docs[: i + 1]) for i in range(len(docs))]
    out["cu_seqlens_padded"] = [0] + [sum(padded[: i + 1]) for i in range(len(padded))]
    out["max_seqlen"] = max(padded)
    return out


def mismatches(got: dict, want: dict) -> list[str]:
    """What of the cut batch ``got`` differs from the model's ``want``, plus its recorded cut."""
    from gdn_cp.megatron.thd_split import recorded_split

    bad = []
    for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        value = got[key]
        if value.dim() != 2 or value.shape[0] != 1:
            bad.append(f"{key} has shape {tuple(value.shape)}, not [1, n]")
        have = value[0].tolist()
        if [float(x) for x in have] != [float(x) for x in want[key]]:
            bad.append(f"{key}: got {have}, want {want[key]}")
    if got["cu_seqlens_padded"].dtype != torch.int32:
        bad.append(f"cu_seqlens_padded has dtype {got['cu_seqlens_padded'].dtype}, TransformerEngine wants int32")
    if got["max_seqlen"].tolist() != [want["max_seqlen"]]:
        bad.append(f"max_seqlen: got {got['max_seqlen'].tolist()}, want [{want['max_seqlen']}]")
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        if recorded_split(got[key]) != PER_DOCUMENT:
            bad.append(f"{key} carries the record {recorded_split(got[key])!r}, not {PER_DOCUMENT!r}")
    return bad


def _flat_batch(docs_per_sample: list[list[int]], seq_length: int, seed: int) -> tuple[dict, list[int]]:
    """A data loader batch of these samples flattened as Megatron-LM's get_batch flattens it, and
    the documents of the flat row (every sample's, in order)."""
    from megatron.core.utils import flatten_batch_for_packed_sequences

    batch = packed_batch(docs_per_sample, seq_length, vocab_size=VOCAB, seed=seed, mbs=len(docs_per_sample))
    batch["tokens"] = torch.arange(1, batch["tokens"].numel() + 1).view_as(batch["tokens"])  # every token its own
    return flatten_batch_for_packed_sequences(batch), [d for docs in docs_per_sample for d in docs]


# name -> (documents per sample, S)
ROWS = {
    "one document": ([[48]], 48),
    "odd lengths": ([[17, 9, 22]], 48),
    "length 1 and 2": ([[1, 2, 45]], 48),
    "many short": ([[3, 5, 1, 7, 2, 6, 4, 8, 5, 7]], 48),
    "two samples": ([[13, 35], [1, 46, 1]], 48),
    "random": ([random_lengths(96, 9, 3), random_lengths(96, 4, 4)], 96),
}


# ------------------------------------------------------------------------------------------
# pad_and_cut in this process
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ROWS))
def test_pad_and_cut_is_the_per_token_model(patched_megatron, name):
    from gdn_cp.megatron.document_padding import pad_and_cut

    samples, s = ROWS[name]
    for cp in (2, 3, 4, 8):
        for local_multiple in (1, 2, 3):
            seen = []
            for rank in range(cp):
                flat, docs = _flat_batch(samples, s, seed=cp)
                want = expected_cut(flat, docs, cp, rank, local_multiple)
                got = pad_and_cut(copy.copy(flat), cp, rank, local_multiple=local_multiple)
                bad = mismatches(got, want)
                assert not bad, (name, cp, rank, local_multiple, bad)
                assert got["tokens"].shape[1] % local_multiple == 0
                seen += [t for t in got["tokens"][0].tolist() if t]
            # every real token on exactly one rank; the pads are as few as the cut needs
            assert sorted(seen) == list(range(1, s * len(samples) + 1)), (name, cp)
            padded = want["cu_seqlens_padded"][-1]
            assert padded - sum(docs) < 2 * cp * len(docs) + math.lcm(2 * cp, cp * local_multiple)


def test_pad_rows_are_out_of_the_loss(patched_megatron):
    """Pads carry label 0 and loss mask 0; a real token keeps its own loss mask (0s included)."""
    from gdn_cp.megatron.document_padding import pad_and_cut

    flat, docs = _flat_batch([[17, 9, 22]], 48, seed=1)
    mask = flat["loss_mask"][0].clone()
    got = pad_and_cut(flat, 2, 0)
    rows, _ = padded_cut_model(docs, 2, 0)
    for i, row in enumerate(rows):
        if row is None:
            assert got["loss_mask"][0, i] == 0 and got["labels"][0, i] == 0 and got["tokens"][0, i] == 0
        else:
            assert got["loss_mask"][0, i] == mask[row]


def test_pad_and_cut_refuses_what_it_cannot_pad(patched_megatron):
    from gdn_cp.megatron.document_padding import pad_and_cut

    flat, _ = _flat_batch([[17, 9, 22]], 48, seed=1)
    with pytest.raises(ValueError, match=r"needs batch\['cu_seqlens'\] as a \[1, n\+1\] tensor"):
        pad_and_cut(dict(flat, cu_seqlens=flat["cu_seqlens"][0]), 2, 0)
    with pytest.raises(ValueError, match="got a batch with an attention_mask"):
        pad_and_cut(dict(flat, attention_mask=torch.ones(1, 1, 48, 48)), 2, 0)
    with pytest.raises(ValueError, match="whose cu_seqlens_padded differs from its cu_seqlens: its rows are padded"):
        pad_and_cut(dict(flat, cu_seqlens_padded=torch.tensor([[0, 20, 32, 48]], dtype=torch.int32)), 2, 0)
    with pytest.raises(ValueError, match="must equal the packed length T_global=47"):
        pad_and_cut(dict(flat, **{k: flat[k][:, :47] for k in ("tokens", "labels", "loss_mask", "position_ids")}),
                    2, 0)
    with pytest.raises(ValueError, match="as \\[1, T\\] tensors of one T"):
        pad_and_cut(dict(flat, labels=flat["labels"][:, :40]), 2, 0)
    assert pad_and_cut(dict(flat, cu_seqlens_padded=flat["cu_seqlens"].clone()), 2, 0)["tokens"].shape == (1, 28)


def test_padded_cut_request_reads_megatron_lms_args():
    """Only --dataloader-inter-document-masking rows that validate_args chose to cut per document."""
    import types

    from gdn_cp.megatron.document_padding import padded_cut_request
    from gdn_cp_testing.megatron.batches import PADDED_CUT_ARGS

    assert padded_cut_request(None) is None
    assert padded_cut_request(types.SimpleNamespace(**PADDED_CUT_ARGS)) == 1
    for change in (dict(linear_cp_thd_split="whole_row"), dict(linear_cp_thd_split=None), dict(sft=True),
                   dict(dataloader_inter_document_masking=False), dict(hybrid_context_parallel=True)):
        assert padded_cut_request(types.SimpleNamespace(**dict(PADDED_CUT_ARGS, **change))) is None, change
    sp = dict(PADDED_CUT_ARGS, sequence_parallel=True, tensor_model_parallel_size=4)
    assert padded_cut_request(types.SimpleNamespace(**sp)) == 4


# ------------------------------------------------------------------------------------------
# Megatron's get_batch_on_this_cp_rank (patched) on CP ranks, with Megatron-LM's args
# ------------------------------------------------------------------------------------------
def _megatron_cut_cases(ctx) -> dict:
    """Every row of ROWS through ``flatten_batch_for_packed_sequences`` + the patched
    ``get_batch_on_this_cp_rank(use_per_sequence_balancing=True)`` on this rank's groups of 2 and 4:
    with Megatron-LM's args asking for the padded cut (and with sequence parallelism at TP=2 / 3), and
    without them (stock: the whole row, no padding). ``{case: problems}``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from gdn_cp.megatron.thd_split import recorded_split
    from gdn_cp_testing.megatron.batches import PADDED_CUT_ARGS, megatron_lm_args

    out = {}
    for cp in (2, 4):
        group, rank = ctx.group(cp), ctx.rank % cp
        for name, (samples, s) in ROWS.items():
            for tp in (1, 3):
                flat, docs = _flat_batch(samples, s, seed=cp)
                want = expected_cut(flat, docs, cp, rank, tp)
                args = dict(PADDED_CUT_ARGS, sequence_parallel=tp > 1, tensor_model_parallel_size=tp)
                with megatron_lm_args(**args):
                    got = get_batch_on_this_cp_rank(copy.copy(flat), is_hybrid_cp=False, cp_group=group,
                                                    use_per_sequence_balancing=True)
                out[(cp, name, tp)] = mismatches(got, want)
            flat, _ = _flat_batch(samples, s, seed=cp)
            with megatron_lm_args(**dict(PADDED_CUT_ARGS, linear_cp_thd_split="whole_row")):
                got = get_batch_on_this_cp_rank(copy.copy(flat), is_hybrid_cp=False, cp_group=group,
                                                use_per_sequence_balancing=True)
            whole = got["tokens"].shape[1] == s * len(samples) // cp and got.get("cu_seqlens_padded") is None
            out[(cp, name, "whole_row")] = [] if whole and recorded_split(got["cu_seqlens"]) == "whole_row" else [
                f"asked for the whole-row cut, got {got['tokens'].shape[1]} rows, record "
                f"{recorded_split(got['cu_seqlens'])!r}"]
    return out


@pytest.mark.megatron
def test_megatrons_splitter_makes_the_per_token_models_cut(patched_megatron, rank_pool):
    results = rank_pool(4).run(_megatron_cut_cases)
    bad = [f"rank {rank} {case}: {problems}" for rank, per_case in enumerate(results)
           for case, problems in per_case.items() if problems]
    assert not bad, "\n".join(bad)
    assert len(results[0]) == 2 * len(ROWS) * 3
