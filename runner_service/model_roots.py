"""Model roots: the only directories LoadModel and LoadWeights may read from."""

from __future__ import annotations

from pathlib import Path

import grpc

from serving_common.errors import ServiceError


class ModelRoots:
    """Confines filesystem reads to configured directories; with none configured, any path is allowed.

    Paths are resolved (symlinks and ``..`` included) before the check, and the check comes
    before anything is read.
    """

    def __init__(self, roots: list[Path] | None = None) -> None:
        self.roots = [Path(root).resolve() for root in roots or []]

    def check(self, path: str, field: str) -> Path:
        resolved = Path(path).resolve()
        if self.roots and not any(resolved.is_relative_to(root) for root in self.roots):
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{field} {path!r} is outside the runner's model roots ({', '.join(map(str, self.roots))})",
            )
        return resolved
