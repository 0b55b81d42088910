"""The demo's training text: the running interpreter's standard-library sources, or the user's.

The default corpus needs no download: the ``.py`` files under ``sysconfig``'s ``stdlib`` path
(installed packages in ``site-packages`` excluded), ordered by the SHA-1 of their relative path
(a fixed shuffle, so the cap picks files from all over the library), concatenated and capped.
Bytes are the tokens (vocabulary 256). The first 90% is training text, the last 10% validation.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Corpus",
    "CorpusError",
    "load_corpus",
    "stdlib_files",
]

DEFAULT_MAX_BYTES = 4_000_000
VAL_FRACTION = 0.1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusError(ValueError):
    """The corpus cannot be used (missing, unreadable, empty or too small); the message says why."""


@dataclass(frozen=True)
class Corpus:
    """Byte tokens split into training and validation text.

    Attributes:
        train, val: ``uint8`` tensors of byte values.
        source: human description ("Python 3.11.7 standard library, 612 files").
        num_files: files read.
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    num_files: int

    @property
    def num_bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def _order_key(root: Path, path: Path) -> str:
    return hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest()


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's root and its ``.py`` files in the corpus order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # never descend into installed packages
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return root, sorted(files, key=lambda p: _order_key(root, p))


def _read_capped(files: list[Path], max_bytes: int, skip_binary: bool) -> tuple[bytes, int]:
    chunks: list[bytes] = []
    total = used = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data or (skip_binary and b"\0" in data[:4096]):
            continue
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        used += 1
    return b"".join(chunks), used


def _user_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _split_sizes(n: int) -> tuple[int, int]:
    """``(training, validation)`` bytes of an ``n``-byte corpus: the last ``VAL_FRACTION``
    (rounded down, at least one byte) is validation text."""
    n_val = max(int(n * VAL_FRACTION), 1)
    return n - n_val, n_val


def _min_total(min_bytes: int) -> int:
    """The smallest corpus size (bytes) whose two parts both hold ``min_bytes`` bytes.

    Both parts grow with the size, so the first size that fits is the exact bound (searched
    rather than derived, so it shares :func:`_split_sizes`' rounding).
    """
    n = 2 * min_bytes
    while min(_split_sizes(n)) < min_bytes:
        n += 1
    return n


def load_corpus(
    path: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES, min_bytes: int = 0
) -> Corpus:
    """Read the corpus and split it.

    Args:
        path: None for the standard library; else a text file, or a folder whose files (sorted by
            relative path, files with NUL bytes skipped) are concatenated.
        max_bytes: cap on the bytes read.
        min_bytes: each of the two splits must hold at least this many bytes.

    Raises:
        CorpusError: missing path, nothing readable, or too little text.
    """
    if path is None:
        root, files = stdlib_files()
        data, used = _read_capped(files, max_bytes, skip_binary=True)
        version = ".".join(map(str, sys.version_info[:3]))
        source = f"Python {version} standard library ({root}), {used} .py files"
        where = f"the standard library at {root}"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise CorpusError(f"--corpus: no such file or folder: {path}")
        if not (p.is_file() or p.is_dir()):
            raise CorpusError(f"--corpus: not a regular file or folder: {path}")
        try:
            data, used = _read_capped(_user_files(p), max_bytes, skip_binary=p.is_dir())
        except OSError as exc:
            raise CorpusError(f"--corpus: cannot read {path}: {exc.strerror or exc}") from None
        if p.is_file() and not data:
            try:
                p.read_bytes()
            except OSError as exc:
                raise CorpusError(f"--corpus: cannot read {path}: {exc.strerror or exc}") from None
        source = f"{p} ({used} file{'s' if used != 1 else ''})"
        where = str(path)
    if not data:
        raise CorpusError(f"--corpus: no text found in {where} (the corpus is empty)")
    n_train, n_val = _split_sizes(len(data))
    if min(n_train, n_val) < min_bytes:
        raise CorpusError(
            f"--corpus: {where} holds {len(data)} bytes; the demo needs at least "
            f"{_min_total(min_bytes)} (the last 10% is held out for validation, and each part "
            f"must hold at least {min_bytes} bytes)"
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return Corpus(tokens[:n_train].clone(), tokens[n_train:].clone(), source, used)
