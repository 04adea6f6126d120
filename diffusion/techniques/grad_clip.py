"""Gradient clipping by global norm (diffusers' training scripts' ``--max_grad_norm``), as a technique: one setting
and Composer's own ``GradientClipping`` algorithm, which clips after backward and before the optimizer steps (the
total norm over every trainable parameter, FSDP2's sharded ones included: torch's clip_grad_norm_ reduces a
DTensor's norm across its shards)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from diffusion.settings import POSITIVE, setting
from diffusion.techniques.technique import Technique


@dataclass
class GradClipSettings:
    max_grad_norm: Optional[float] = setting(
        None,
        "clip the gradients' total norm to this before each optimizer step (diffusers' training scripts: 1.0)",
        POSITIVE,
        shown="off",
    )


class GradClip(Technique):
    NAME = "grad_clip"
    SETTINGS = GradClipSettings
    SWITCH = "max_grad_norm"

    @classmethod
    def install(cls, cfg, model) -> list:
        from composer.algorithms import GradientClipping

        return [GradientClipping(clipping_type="norm", clipping_threshold=cfg.max_grad_norm)]

    @classmethod
    def results(cls, cfg, model) -> dict:
        return {"max_norm": cfg.max_grad_norm}
