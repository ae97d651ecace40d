"""Content fingerprints: sha256 over canonical JSON and file bytes (the cache keys)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

FP_LENGTH = 16  # hex characters kept (64 bits): short paths, collisions negligible here


def canonical_json(payload: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, floats via repr."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(payload: Any) -> str:
    """sha256 of the canonical JSON of ``payload``, truncated to ``FP_LENGTH`` hex chars."""
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:FP_LENGTH]


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Full sha256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def tree_digest(root: Path, pattern: str = "*.py", skip: frozenset[str] = frozenset()) -> str:
    """sha256 over the relative paths and bytes of files matching ``pattern`` under ``root``, but
    those whose relative path is in ``skip``."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob(pattern)):
        if "__pycache__" in path.parts or str(path.relative_to(root)) in skip:
            continue
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
