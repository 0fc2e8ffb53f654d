"""The names the loaded model is served under, as vLLM's and SGLang's ``--served-model-name``.

``--served-model-name`` (repeatable) names ``--model``: while that model is loaded, the HTTP API
lists those names in ``GET /v1/models``, a request's ``model`` must be one of them, and GetStatus
shows them. Without the flag, or once Init has loaded another model, the model's source is its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion.v1 import common_pb2
from serving_common.hub_ids import HubId


@dataclass(frozen=True)
class ServedNames:
    model: str  # --model
    given: tuple[str, ...]  # --served-model-name

    @property
    def names(self) -> tuple[str, ...]:
        """The flag's names in the order given, each once (an empty one is no name)."""
        return tuple(name for name in dict.fromkeys(self.given) if name)

    def is_model(self, loaded: common_pb2.ModelInfo) -> bool:
        """Whether ``loaded`` is ``--model``: its source, or for a Hugging Face id the commit a
        (restarted) runner was pinned to."""
        if loaded.source == self.model:
            return True
        asked = HubId.parse(self.model)
        return asked is not None and bool(loaded.revision) and loaded.source == str(asked.pinned(loaded.revision))

    def renames(self, loaded: common_pb2.ModelInfo) -> bool:
        """Whether the flag's names stand for ``loaded`` (it is ``--model``) instead of its source."""
        return bool(self.names) and self.is_model(loaded)

    def of(self, loaded: common_pb2.ModelInfo | None) -> tuple[str, ...]:
        """The names ``loaded`` is served under: the flag's, else ``--model`` as given (an id without
        the commit it was pinned to), else its source; none without a model."""
        if loaded is None:
            return ()
        if not self.is_model(loaded):
            return (loaded.source,)
        return self.names or (self.model,)
