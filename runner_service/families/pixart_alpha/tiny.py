"""PixArt-alpha's tiny random build: PixArt-Sigma's components in the alpha pipeline."""

from __future__ import annotations

from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import PixArtAlphaPipeline

from runner_service.families.pixart_sigma.tiny import pixart_components


def build_pixart_alpha() -> PixArtAlphaPipeline:
    return PixArtAlphaPipeline(**pixart_components())
