"""The training benchmark's data: the Python standard library's own source, byte-level tokens, written as a
Megatron indexed dataset (``.bin`` / ``.idx``) with megatron-core's ``IndexedDatasetBuilder``.

Why: Megatron-LM's mock data is memorised within 6 iterations, after which bf16 runs drift chaotically and
no tolerance tells a right run from a wrong one (../shared/DESIGN.md, "A training comparison is only as good
as the data is hard"). Real text that every machine has offline (the GPU machine has no network): the
source of the running Python's standard library. A 6-layer model that reads ~16K bytes per iteration is
far from learning 4 MB of code in 50 iterations (no sample repeats before ~240).

What, so that nothing depends on the machine beyond the source text:

* files: every non-empty ``*.py`` under the stdlib folder (``sysconfig``'s ``stdlib``), without test suites and the
  packages distributions ship apart (Debian / Ubuntu: tkinter, idlelib, lib2to3, ensurepip) or that are
  generated tables (encodings, pydoc_data) (:data:`SKIP`); taken in the order of the sha256 of their
  relative path (an even spread over the library, the same on every machine) up to ``max_bytes``, then
  written in path order;
* documents: a file is cut before each top-level ``def`` / ``class`` / decorator (:func:`documents`), the
  module's head being its first document: ~1.7 KB on average, so a row of 4096 byte tokens holds several
  documents and ``--dataloader-inter-document-masking`` cuts at real boundaries (whole files, ~16 KB on
  average, would leave most rows a single document);
* tokens: a byte is its own id (0..255); each document ends with :data:`EOD` (as Megatron's
  ``preprocess_data.py --append-eod``). Megatron-LM's ``--tokenizer-type NullTokenizer --vocab-size 258``
  has eod ``vocab_size - 1`` = 257; id 256 is left free for ``--sft``'s padding (:data:`PAD`).

:func:`build` returns (and writes beside the data as ``<prefix>.json``) the provenance the results record:
Python version, source folder, file / document / token counts, sha256 of the file list, the ``.bin`` and
the ``.idx``. ``python -m gdn_cp_testing.megatron.byte_text OUT_DIR`` builds it from the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sysconfig
from pathlib import Path
from typing import Optional

__all__ = ["EOD", "PAD", "PREFIX", "VOCAB", "build", "corpus_text", "documents", "select_files", "sha256_of",
           "source_files"]

logger = logging.getLogger(__name__)

VOCAB = 258
"""``--vocab-size`` of every run: bytes 0..255, :data:`PAD`, :data:`EOD` (NullTokenizer's eod is vocab - 1)."""
PAD = VOCAB - 2
EOD = VOCAB - 1
PREFIX = "stdlib_bytes"
MAX_BYTES = 4_000_000
"""About 4M tokens: 50 iterations of global batch 4 x 4096 read 0.8M."""

SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib",
                  "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip", "encodings", "pydoc_data"})
"""Folder names whose files are left out: test suites, packages distributions ship separately, generated tables."""

_BLOCK_START = (b"def ", b"async def ", b"class ", b"@")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root) -> list[str]:
    """The non-empty ``*.py`` files under ``root`` outside :data:`SKIP`, as sorted relative POSIX paths."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"source={str(root)!r} is not a folder: pass the folder of a Python standard library "
                         "(default: this Python's, sysconfig.get_paths()['stdlib'])")
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and p.stat().st_size and not SKIP.intersection(p.relative_to(root).parts))


def select_files(root, max_bytes: int = MAX_BYTES) -> list[str]:
    """:func:`source_files` in the order of the sha256 of their path, up to the first that would pass
    ``max_bytes``; returned in path order."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r} must be positive (the corpus size in bytes, e.g. {MAX_BYTES})")
    root, picked, total = Path(root), [], 0
    for rel in sorted(source_files(root), key=lambda r: hashlib.sha256(r.encode()).hexdigest()):
        size = (root / rel).stat().st_size
        if total + size > max_bytes:
            break
        picked.append(rel)
        total += size
    if not picked:
        raise ValueError(f"no file of source={str(root)!r} fits max_bytes={max_bytes}: raise max_bytes")
    return sorted(picked)


def documents(data: bytes) -> list[bytes]:
    """``data`` (a file's bytes) cut before each top-level ``def`` / ``async def`` / ``class`` / decorator
    line that does not follow a decorator; the pieces join back to ``data``. Empty data: no document."""
    out, current, previous = [], [], b""
    for line in data.splitlines(keepends=True):
        if line.startswith(_BLOCK_START) and current and not previous.startswith(b"@"):
            out.append(b"".join(current))
            current = []
        current.append(line)
        if line.strip():
            previous = line
    if current:
        out.append(b"".join(current))
    return out


def corpus_text(source=None, max_bytes: int = MAX_BYTES) -> bytes:
    """The selected files' bytes, in path order (the text the SFT set is cut from)."""
    root = Path(source) if source is not None else stdlib_root()
    return b"".join((root / rel).read_bytes() for rel in select_files(root, max_bytes))


def sha256_of(path: Path) -> str:
    """The file's sha256, hex (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(out_dir, *, source=None, max_bytes: int = MAX_BYTES, prefix: str = PREFIX) -> dict:
    """Write ``out_dir/<prefix>.bin`` / ``.idx`` / ``.json`` (see the module docstring) and return the
    provenance: ``{"path_prefix", "source", "python", "files", "documents", "bytes", "tokens",
    "vocab_size", "eod", "max_bytes", "files_sha256", "bin_sha256", "idx_sha256"}``."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    root = Path(source) if source is not None else stdlib_root()
    files = select_files(root, max_bytes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path_prefix = str(out_dir / prefix)
    dtype = DType.optimal_dtype(VOCAB)
    builder = IndexedDatasetBuilder(get_bin_path(path_prefix), dtype=dtype)
    n_docs = n_bytes = 0
    for rel in files:
        data = (root / rel).read_bytes()
        n_bytes += len(data)
        for doc in documents(data):
            tokens = np.append(np.frombuffer(doc, dtype=np.uint8).astype(dtype), dtype(EOD))
            builder.add_document(tokens, [tokens.size])
            n_docs += 1
    builder.finalize(get_idx_path(path_prefix))
    provenance = {
        # the library read is this Python's unless a source folder was given
        "path_prefix": path_prefix, "source": str(root),
        "python": platform.python_version() if source is None else "unknown (source given)",
        "python_implementation": platform.python_implementation(), "files": len(files), "documents": n_docs,
        "bytes": n_bytes, "tokens": n_bytes + n_docs, "vocab_size": VOCAB, "eod": EOD, "max_bytes": max_bytes,
        "files_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest(),
        "bin_sha256": sha256_of(Path(get_bin_path(path_prefix))), "idx_sha256": sha256_of(Path(get_idx_path(path_prefix))),
    }
    (out_dir / f"{prefix}.json").write_text(json.dumps(provenance, indent=1) + "\n", encoding="utf-8")
    logger.info("byte-level stdlib text: %d files, %d documents, %d tokens in %s (bin sha256 %s)", len(files),
                n_docs, provenance["tokens"], path_prefix, provenance["bin_sha256"][:12])
    return provenance


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gdn_cp_testing.megatron.byte_text", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for <prefix>.bin / .idx / .json")
    p.add_argument("--source", help="a standard library folder (default: this Python's)")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, help=f"corpus size in bytes (default {MAX_BYTES})")
    args = p.parse_args(argv)
    print(json.dumps(build(args.out_dir, source=args.source, max_bytes=args.max_bytes), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
