"""The third-party libraries of the runner, quietened before they load.

transformers and diffusers log errors only and draw no progress bars: their chatter (download
bars, accelerate hints, transformers' notices that an image processor falls back to its PIL
version without torchvision) tells an operator nothing and would drown the runner's own log.
Set before diffusers is imported, since its import is what triggers those notices. The same goes
for the warnings torchao logs when it loads (its compiled kernels built for another Python or
device "could not load", "no triton") and torch's pytree deprecation that torchao's registrations
trigger: none is about anything the runner uses. At ``--log-level debug`` all of them are kept.

transformers 5 also swaps layers for kernels it downloads from the Hub (``use_kernels`` defaults
to on). A runner downloads nothing at run time, and on a CUDA machine without the ``kernels``
package that default makes every ``from_pretrained`` fail, so ``USE_HUB_KERNELS`` defaults to off
here (an operator who wants Hub kernels sets it).
"""

from __future__ import annotations

import logging
import os

# The loggers of the warnings every start logs (torchao's import), kept to errors but at debug.
START_UP_NOISE = ("torchao", "torch.utils._pytree")


def quiet_libraries(debug: bool = False) -> None:
    """No progress bars; the libraries log errors only, or all they would by default with ``debug``."""
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not debug:
        transformers.utils.logging.set_verbosity_error()
        for name in START_UP_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    if not debug:
        diffusers.utils.logging.set_verbosity_error()
