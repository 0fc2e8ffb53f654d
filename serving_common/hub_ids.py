"""How a Hugging Face id is written as a model source: ``org/name`` or ``org/name@revision``.

Only the spelling, so that every side reads it alike: the runner (``runner_service.model_sources``
decides whether a source is an id and finds its snapshot), the worker (which pins the commit a
runner resolved, and lets the HTTP ``model`` field name the id without it) and the CLI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The hub's own rules for a repo id (huggingface_hub's validate_repo_id): letters, digits, "-",
# "_" and "." in two parts, at most 96 characters, no "--" or "..".
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
# A branch, tag or commit (git's ref names, as far as a path in the cache can hold them safely).
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]*")
MAX_REPO_ID = 96
MAX_REVISION = 255


@dataclass(frozen=True)
class HubId:
    """A Hugging Face model id and the revision asked for (``""``: the default branch, ``main``)."""

    repo_id: str
    revision: str = ""

    @classmethod
    def parse(cls, source: str) -> HubId | None:
        """``source`` as an id, or None where it is not spelt as one (a built-in name, a path)."""
        repo_id, at, revision = source.partition("@")
        if not (len(repo_id) <= MAX_REPO_ID and _REPO_ID.fullmatch(repo_id)) or "--" in repo_id or ".." in repo_id:
            return None
        if at and not (len(revision) <= MAX_REVISION and _REVISION.fullmatch(revision)
                       and ".." not in revision and not revision.endswith("/")):
            return None
        return cls(repo_id, revision)

    def pinned(self, commit: str) -> HubId:
        """The same id at ``commit``, the snapshot a runner resolved it to."""
        return HubId(self.repo_id, commit)

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id
