"""Wuerstchen's tiny random build: prior and decoder in one combined pipeline."""

from __future__ import annotations

from typing import TypeVar

import diffusers
from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt
from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
from diffusers.pipelines.deprecated.wuerstchen.pipeline_wuerstchen_combined import WuerstchenCombinedPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.schedulers.scheduling_ddpm_wuerstchen import DDPMWuerstchenScheduler
from transformers import CLIPTextModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import clip_config, clip_tokenizer

_Pipeline = TypeVar("_Pipeline", bound=DiffusionPipeline)


def build_wuerstchen() -> WuerstchenCombinedPipeline:
    tokenizer = clip_tokenizer()
    prior = seeded(lambda: WuerstchenPrior(c_in=2, c=8, depth=2, c_cond=32, c_r=8, nhead=2).eval())
    decoder = seeded(
        lambda: WuerstchenDiffNeXt(
            c_cond=32,
            c_hidden=[32],
            nhead=[-1],
            blocks=[4],
            level_config=["CT"],
            clip_embd=32,
            inject_effnet=[False],
        ).eval()
    )
    vqgan = seeded(lambda: PaellaVQModel(bottleneck_blocks=1, embed_dim=32, num_vq_embeddings=2).eval())
    pipeline = WuerstchenCombinedPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer)).eval()),
        decoder=decoder,
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan,
        prior_tokenizer=clip_tokenizer(),
        prior_text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer)).eval()),
        prior_prior=prior,
        prior_scheduler=DDPMWuerstchenScheduler(),
    )
    return _declare_own_modules(pipeline)


def _declare_own_modules(pipeline: _Pipeline) -> _Pipeline:
    """Names each component diffusers does not export by its module, so ``from_pretrained`` finds it.

    Diffusers moved Wuerstchen to ``diffusers.pipelines.deprecated.wuerstchen`` and no longer
    exports its models (``WuerstchenPrior``, ``WuerstchenDiffNeXt``, ``PaellaVQModel``) from
    ``diffusers`` or ``diffusers.pipelines``, yet ``save_pretrained`` declares them as
    ``["diffusers", "WuerstchenPrior"]``, which ``from_pretrained`` cannot resolve (nor the
    ``["wuerstchen", ...]`` of the published models: huggingface/diffusers#14008). Declared by
    their full module path instead, they load: ``from_pretrained`` takes a library that is
    neither transformers nor diffusers from ``sys.modules``, and importing the pipeline class,
    which it does first, imports these modules.
    """
    for name, component in pipeline.components.items():
        declared = pipeline.config.get(name)
        if component is None or not isinstance(declared, (list, tuple)) or declared[0] != "diffusers":
            continue
        if not hasattr(diffusers, declared[1]):
            pipeline.register_to_config(**{name: (type(component).__module__, declared[1])})  # type: ignore[no-untyped-call]
    return pipeline
