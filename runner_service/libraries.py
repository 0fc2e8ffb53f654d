"""The third-party libraries of the runner, quietened before they load.

transformers and diffusers log errors only and draw no progress bars: their chatter (download
bars, accelerate hints, transformers' notices that an image processor falls back to its PIL
version without torchvision) tells an operator nothing and would drown the runner's own log.
Set before diffusers is imported, since its import is what triggers those notices.

transformers 5 also swaps layers for kernels it downloads from the Hub (``use_kernels`` defaults
to on). A runner downloads nothing at run time, and on a CUDA machine without the ``kernels``
package that default makes every ``from_pretrained`` fail, so ``USE_HUB_KERNELS`` defaults to off
here (an operator who wants Hub kernels sets it).
"""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    import transformers

    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
