"""LoadWeights takes a checkpoint's own names and maps them through the module's own key conversion.

transformers saves some models under other names than it loads them with (Qwen-Image's text
encoder, a ``Qwen2_5_VLForConditionalGeneration``, saves ``model.layers.*`` and is
``model.language_model.layers.*`` once loaded); diffusers renames an old checkpoint's attention
blocks on load (``query`` to ``to_q``). Either form loads, the names reported are the module's,
and a name neither conversion knows is still refused with nothing changed. The tiny builds of
``runner_service.families``, loaded in this process on the CPU: no downloads.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from runner_service.loaded_model import LoadedModel, check_source, load_model
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache
from runner_service.models.catalog import build_family
from runner_service.platforms.cpu import CpuPlatform
from runner_service.weights import load_weights
from serving_common.errors import ServiceError

MAX_BYTES = 1 << 30
# diffusers' old attention block names and today's (``ModelMixin._fix_state_dict_keys_on_load``).
OLD_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}

pytestmark = [pytest.mark.timeout(120), pytest.mark.process]  # builds two families in this process


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("key-conversion")


@pytest.fixture(scope="module")
def roots(root):
    return ModelRoots([root])


@pytest.fixture(scope="module")
def platform(root):
    platform = CpuPlatform(root / "spill")
    yield platform
    platform.offload_store().close()


def loaded(family: str, root, roots, platform) -> LoadedModel:
    directory = build_family(family, root / family)
    return load_model(check_source(str(directory), None, roots, HubCache()), None, platform)


@pytest.fixture(scope="module")
def qwen(root, roots, platform):
    return loaded("qwen-image", root, roots, platform)


@pytest.fixture(scope="module")
def sd(root, roots, platform):
    return loaded("sd", root, roots, platform)


def snapshot(model: LoadedModel) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value.detach().clone() for name, component in model.components.items()
            for key, value in component.module.state_dict().items()}


def same(model: LoadedModel, before: dict[str, torch.Tensor]) -> bool:
    now = snapshot(model)
    return now.keys() == before.keys() and all(torch.equal(now[key], before[key]) for key in before)


def changed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other values of the same shapes and dtypes, so a load that copies nothing shows."""
    return {key: (value + 1 if value.is_floating_point() else value).contiguous() for key, value in tensors.items()}


def refused(model: LoadedModel, path, roots) -> ServiceError:
    before, version, updates = snapshot(model), model.weights_version, len(model.weight_updates)
    with pytest.raises(ServiceError) as error:
        load_weights(model, path, roots, MAX_BYTES)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert same(model, before) and model.weights_version == version and len(model.weight_updates) == updates
    return error.value


def test_the_text_encoders_own_save_pretrained_file_loads_back_under_the_modules_names(qwen, root, roots):
    text_encoder = qwen.components["text_encoder"].module
    own = sorted(text_encoder.state_dict())
    assert any(".language_model." in key for key in own)
    text_encoder.save_pretrained(root / "text-encoder")
    saved = load_file(root / "text-encoder" / "model.safetensors")
    # transformers saved its checkpoint's names, not the module's: the case this is about.
    assert any(key.startswith("model.layers.") for key in saved)
    assert not any(".language_model." in key for key in saved) and len(saved) == len(own)
    update = changed(saved)
    path = root / "text-encoder-update.safetensors"
    save_file({f"text_encoder.{key}": value for key, value in update.items()}, str(path))
    version = qwen.weights_version

    result = load_weights(qwen, path, roots, MAX_BYTES)

    assert result.names == [f"text_encoder.{key}" for key in own]
    assert result.update is not None and result.update.components == frozenset({"text_encoder"})
    assert result.weights_version == qwen.weights_version != version
    # What the module saves now is the file loaded, bit for bit.
    text_encoder.save_pretrained(root / "text-encoder-after")
    after = load_file(root / "text-encoder-after" / "model.safetensors")
    assert after.keys() == update.keys() and all(torch.equal(after[key], update[key]) for key in update)


def test_an_unknown_name_is_still_refused_and_nothing_changes(qwen, root, roots):
    layer = qwen.components["text_encoder"].module.state_dict()["model.language_model.layers.0.input_layernorm.weight"]
    path = root / "unknown.safetensors"
    save_file({"text_encoder.model.layers.0.input_layernorm.weight": layer + 1,
               "text_encoder.model.layers.0.no_such_norm.weight": layer.clone()}, str(path))
    error = refused(qwen, path, roots)
    assert [field for field, _ in error.violations] == ["tensors[text_encoder.model.layers.0.no_such_norm.weight]"]


def test_one_tensor_under_both_its_names_is_refused(qwen, root, roots):
    layer = qwen.components["text_encoder"].module.state_dict()["model.language_model.norm.weight"]
    path = root / "twice.safetensors"
    save_file({"text_encoder.model.norm.weight": layer + 1, "text_encoder.model.language_model.norm.weight": layer + 2},
              str(path))
    error = refused(qwen, path, roots)
    assert len(error.violations) == 1 and "model.language_model.norm.weight" in error.violations[0][1]


def test_an_old_checkpoints_attention_block_names_load_as_diffusers_loads_them(sd, root, roots):
    vae = sd.components["vae"].module.state_dict()
    attention = {key: value for key, value in vae.items() if ".mid_block.attentions.0." in key}
    update = changed(attention)
    old = {}
    for key, value in update.items():
        for new, before in OLD_ATTENTION.items():
            key = key.replace(f".attentions.0.{new}.", f".attentions.0.{before}.")
        old[f"vae.{key}"] = value
    assert any(".query." in key for key in old) and any(".proj_attn." in key for key in old)
    path = root / "old-vae-attention.safetensors"
    save_file(old, str(path))

    result = load_weights(sd, path, roots, MAX_BYTES)

    assert result.names == sorted(f"vae.{key}" for key in attention)
    now = sd.components["vae"].module.state_dict()
    assert all(torch.equal(now[key], update[key]) for key in attention)
