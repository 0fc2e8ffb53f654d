"""A Hugging Face hub cache written by hand, in the hub library's own layout, for tests that resolve
ids offline with the real ``huggingface_hub``:

    <cache>/models--ORG--NAME/blobs/<sha256>             each file's bytes, once
    <cache>/models--ORG--NAME/snapshots/<commit>/<path>  symlinks to ../../blobs/<sha256>
    <cache>/models--ORG--NAME/refs/<branch or tag>       the commit it points at
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(text: str) -> str:
    """A made-up 40-hex commit id, the same for the same text."""
    return hashlib.sha1(text.encode()).hexdigest()


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def write_snapshot(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Writes ``model_dir``'s files (a ``save_pretrained`` directory) as ``repo_id``'s snapshot
    ``commit``, pointed at by ``refs``; returns the snapshot folder."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    for file in sorted(path for path in model_dir.rglob("*") if path.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
        link = snapshot / file.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        point(cache, repo_id, ref, commit)
    return snapshot


def point(cache: Path, repo_id: str, ref: str, commit: str) -> None:
    """Moves ``ref`` of ``repo_id`` to ``commit``, as a later download of that branch would."""
    path = repo_folder(cache, repo_id) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)
