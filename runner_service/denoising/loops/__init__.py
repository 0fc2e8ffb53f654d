"""Step-level denoising loops: what they share (``base``) and one module per family."""

from runner_service.denoising.loops.base import (
    DenoisingLoop,
    Sequence,
    SequenceSpec,
    loop_for,
    max_sequence_length,
)

__all__ = ["DenoisingLoop", "Sequence", "SequenceSpec", "loop_for", "max_sequence_length"]
