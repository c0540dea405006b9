"""What identifies a folder's content: the digest of a published artifact, the fingerprint of an external folder.

A digest names the bytes (stage keys hash input digests); a fingerprint only the files' paths, sizes and mtimes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from posttrain_core.artifacts.fsio import content_files, walk_files

DIGEST_PREFIX = "blake3:"


def content_digest(folder: str | os.PathLike, like: str | None = None) -> str:
    """The digest of a local folder's content: its files' sorted relative paths, sizes and bytes; a top-level
    manifest.json is excluded (it holds the digest itself).

    BLAKE3, written `blake3:<64 hex>`: a cryptographic hash about 3x faster than sha256 on one core, so digesting
    an RL update's checkpoint at publish costs less of each iteration. Artifacts of older stores hold a bare sha256
    hex digest: `like` = such a digest recomputes the content the same way (verifying a download of an old artifact).
    """
    if like is not None and not like.startswith(DIGEST_PREFIX):
        h, prefix = hashlib.sha256(), ""
    else:
        import blake3

        h, prefix = blake3.blake3(), DIGEST_PREFIX
    _hash_files(h, content_files(Path(folder)))
    return prefix + h.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """The digest of one file's name and bytes (`blake3:<64 hex>`): what identifies an external file."""
    import blake3

    h = blake3.blake3()
    _hash_files(h, [(Path(path).name, Path(path))])
    return DIGEST_PREFIX + h.hexdigest()


def _hash_files(h, files) -> None:  # noqa: ANN001 (a hashlib or blake3 object; (rel, path) pairs)
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    for rel, path in files:
        h.update(f"{rel}\0{path.stat().st_size}\0".encode())
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])


def fingerprint(path: Path) -> str:
    """sha256 hex of the (relative path, size, mtime_ns) of the files of a folder, or of one file: what stands for
    the digest of an external folder (see `ArtifactStore.register_external`)."""
    files = walk_files(path) if path.is_dir() else [(path.name, path)]
    h = hashlib.sha256()
    for rel, file in files:
        st = file.stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
