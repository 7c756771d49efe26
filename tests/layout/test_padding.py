"""gdn_cp.layout.padding: documents padded at their end to the per-document cut, and each rank's rows
of the padded row (the per-token check of the whole data path is tests/megatron/test_document_padding.py)."""

from __future__ import annotations

import pytest

from gdn_cp.layout import PAD_SOURCE, pad_documents, padded_rank_sources, padded_row_multiple


def test_each_document_gets_the_fewest_pads_at_its_end():
    assert pad_documents([0, 17, 26, 48], 2) == (0, 20, 32, 56)
    assert pad_documents([0, 8, 16], 2) == (0, 8, 16)  # nothing to pad
    assert pad_documents([0, 3, 3, 8], 2) == (0, 4, 4, 12)  # an empty slot stays empty
    assert pad_documents([0, 1], 8) == (0, 16)
    # the last document takes what the row multiple needs (each rank a multiple of TP=3 rows at CP=2)
    assert padded_row_multiple(2, 3) == 12 and pad_documents([0, 17, 26, 48], 2, 12) == (0, 20, 32, 60)
    assert padded_row_multiple(4, 2) == 8 and padded_row_multiple(4, 1) == 8 and padded_row_multiple(3, 4) == 12


def test_every_real_row_is_held_once_and_the_pads_follow_their_document():
    cu = [0, 17, 26, 48]
    padded = pad_documents(cu, 2)
    rows = [padded_rank_sources(cu, padded, 2, r).tolist() for r in range(2)]
    assert all(len(r) == padded.total // 2 for r in rows)
    assert sorted(x for r in rows for x in r if x != PAD_SOURCE) == list(range(48))
    assert rows[0][:10] == [0, 1, 2, 3, 4, 15, 16, -1, -1, -1]  # doc 0: parts 0 and 3 (its last 3 rows pads)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="row_multiple must be a positive multiple of 2\\*cp=4"):
        pad_documents([0, 6], 2, 6)
    with pytest.raises(ValueError, match="padded document 0 has 4 rows for 6 real ones"):
        padded_rank_sources([0, 6], [0, 4], 2, 0)
    with pytest.raises(ValueError, match="padded document 0 has 6 rows for 5 real ones; every padded length must"):
        padded_rank_sources([0, 5], [0, 6], 2, 0)
    with pytest.raises(ValueError, match="cu has 1 documents and padded 2"):
        padded_rank_sources([0, 4], [0, 4, 8], 2, 0)
    with pytest.raises(ValueError, match="local_multiple must be a positive int"):
        padded_row_multiple(2, 0)
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 2\\)"):
        padded_rank_sources([0, 4], [0, 4], 2, 2)
