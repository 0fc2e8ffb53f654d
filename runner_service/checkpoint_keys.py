"""A checkpoint's tensor names as a loaded module names them.

transformers renames some checkpoints' keys when it loads them and back when it saves them
(Qwen2.5-VL's ``model.layers.*`` is ``model.language_model.layers.*`` once loaded): a component's
own ``save_pretrained`` file then does not use the names its loaded module has. The module's own
conversion mapping (``get_model_conversion_mapping``, applied with transformers' own
``rename_source_key``) maps them back, so LoadWeights and PushWeights take either form. Only
renamings are followed: a converter that reshapes tensors (fused projections, say) would change
the tensors too, so those keys stay unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.modeling_utils import PreTrainedModel

logger = logging.getLogger(__name__)


def loaded_names(module: torch.nn.Module, keys: Iterable[str], state: dict[str, torch.Tensor]) -> dict[str, str]:
    """For each key that is not already one of ``state``'s names, the name the module's own
    checkpoint conversion gives it, when that is one of ``state``'s names."""
    missing = [key for key in keys if key not in state]
    if not missing or not isinstance(module, PreTrainedModel):
        return {}
    transforms = get_model_conversion_mapping(module, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    found = {}
    for key in missing:
        renamed, converted = rename_source_key(key, renamings, converters, module.base_model_prefix, state)
        if converted is None and renamed in state:
            found[key] = renamed
    return found
