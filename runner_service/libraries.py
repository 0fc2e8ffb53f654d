"""The third-party libraries of the runner, quietened before they load.

transformers and diffusers log errors only and draw no progress bars: their chatter (download
bars, accelerate hints, transformers' notices that an image processor falls back to its PIL
version without torchvision) tells an operator nothing and would drown the runner's own log.
Set before diffusers is imported, since its import is what triggers those notices.
"""

from __future__ import annotations


def quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
