"""The training benchmark's data (gdn_cp_testing.megatron.byte_text): which files, how they are cut into
documents, the indexed dataset megatron-core reads back, and that nothing but the source text decides it."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from gdn_cp_testing.megatron import byte_text

MODULE = b'''"""A module."""
import os


@decorator
@other(1)
def f(x):
    def inner():
        return 1
    return inner


# a comment that stays with what precedes it
class C:
    @property
    def p(self):
        return 2
async def g():
    pass
x = 1
'''


def test_documents_cut_before_top_level_blocks_and_join_back():
    docs = byte_text.documents(MODULE)
    assert b"".join(docs) == MODULE
    assert [d.splitlines()[0] for d in docs] == [b'"""A module."""', b"@decorator", b"class C:", b"async def g():"]
    assert b"def inner" in docs[1] and b"@property" in docs[2] and docs[3].endswith(b"x = 1\n")
    assert byte_text.documents(b"") == [] and byte_text.documents(b"def f(): pass") == [b"def f(): pass"]
    crlf = b"import os\r\ndef f():\r\n    pass\r\n"
    assert byte_text.documents(crlf) == [b"import os\r\n", b"def f():\r\n    pass\r\n"]


def _tree(root, order):
    """A small standard library in ``root``; files created in ``order`` (a file system lists them in
    creation order, the builder must not care)."""
    files = {"a.py": MODULE, "pkg/__init__.py": b"", "pkg/b.py": b"def b():\n    return 1\n" * 40,
             "zz.py": b"class Z:\n    pass\n" * 30, "test/test_a.py": b"def test(): pass\n",
             "site-packages/foo.py": b"x = 1\n", "encodings/cp1.py": b"table = 1\n", "tkinter/tk.py": b"t = 1\n",
             "notes.txt": b"not python\n"}
    for rel in (sorted(files) if order == "sorted" else sorted(files, reverse=True)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[rel])
    return root


def test_select_files_leaves_out_tests_and_split_packages_and_keeps_to_the_budget(tmp_path):
    root = _tree(tmp_path / "lib", "sorted")
    assert byte_text.source_files(root) == ["a.py", "pkg/b.py", "zz.py"]  # no empty file: no document
    assert byte_text.select_files(root, 10**6) == byte_text.source_files(root)
    # a prefix of the sha256-of-path order, up to the budget, returned in path order
    order = sorted(byte_text.source_files(root), key=lambda r: hashlib.sha256(r.encode()).hexdigest())
    sizes = [(root / rel).stat().st_size for rel in order]
    for n in (1, 2):
        budget = sum(sizes[:n])
        assert byte_text.select_files(root, budget) == sorted(order[:n])
        assert byte_text.select_files(root, budget + sizes[n] - 1) == sorted(order[:n])
    with pytest.raises(ValueError, match="max_bytes=0 must be positive"):
        byte_text.select_files(root, 0)
    with pytest.raises(ValueError, match="no file of source=.* fits max_bytes=1: raise max_bytes"):
        byte_text.select_files(root, 1)
    with pytest.raises(ValueError, match="source='/nonexistent' is not a folder"):
        byte_text.source_files("/nonexistent")


@pytest.mark.megatron
def test_build_is_deterministic_readable_and_records_its_provenance(tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    one = byte_text.build(tmp_path / "out1", source=_tree(tmp_path / "one", "sorted"))
    two = byte_text.build(tmp_path / "out2", source=_tree(tmp_path / "two" / "deeper", "reversed"))
    # the same text in another folder, written in another order: the same bytes
    same = ("files", "documents", "bytes", "tokens", "files_sha256", "bin_sha256", "idx_sha256")
    assert {k: one[k] for k in same} == {k: two[k] for k in same}
    assert json.loads((tmp_path / "out1" / "stdlib_bytes.json").read_text()) == one
    assert one["python"] == "unknown (source given)" and one["source"] == str(tmp_path / "one")
    assert one["vocab_size"] == 258 and one["eod"] == 257
    root = tmp_path / "one"
    docs = [d for rel in byte_text.select_files(root) for d in byte_text.documents((root / rel).read_bytes())]
    assert one["files"] == 3 and one["documents"] == len(docs) and one["bytes"] == sum(map(len, docs))
    assert one["tokens"] == one["bytes"] + one["documents"]  # one EOD per document
    ds = IndexedDataset(one["path_prefix"])
    assert len(ds) == len(docs) and ds.sequence_lengths.dtype == np.int32 and ds[0].dtype == np.uint16
    for i, doc in enumerate(docs):  # a byte is its own id, each document ends with EOD
        assert ds[i].tolist() == list(doc) + [257]
    assert os.path.getsize(one["path_prefix"] + ".bin") == 2 * one["tokens"]


def test_corpus_text_is_the_selected_files_in_path_order(tmp_path):
    root = _tree(tmp_path / "lib", "reversed")
    text = byte_text.corpus_text(root)
    assert text == b"".join((root / r).read_bytes() for r in ["a.py", "pkg/b.py", "zz.py"])
    assert byte_text.corpus_text(root, 1000) == b"".join((root / r).read_bytes() for r in byte_text.select_files(root, 1000))
    assert len(byte_text.corpus_text()) > 1_000_000  # this Python's own library: the real source
