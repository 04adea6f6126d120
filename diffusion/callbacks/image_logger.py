"""Samples fixed prompts during training (with the EMA weights when the run keeps them), saves PNGs and
a grid under ``folder/ba{batch}/`` and sends them to the run's loggers (wandb, tensorboard).

Every rank samples (sharded models need all ranks in each forward); rank 0 writes and logs.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from composer.core import Callback, State, Time
from composer.loggers import Logger
from composer.utils import dist


class ImageLogger(Callback):
    def __init__(
        self,
        prompts: list[str],
        interval: str,
        folder: str,
        tokenizers: dict,
        *,
        steps: int = 20,
        guidance_scale: float = 1.0,
        image_size: int | None = None,
        seed: int = 0,
    ):
        self.prompts = list(prompts)
        self.interval = Time.from_timestring(interval)
        self.folder = folder
        self.tokenizers = tokenizers
        self.steps, self.guidance_scale, self.image_size, self.seed = steps, guidance_scale, image_size, seed

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.get(self.interval.unit).value % self.interval.value == 0:
            self.log_samples(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.get(self.interval.unit).value % self.interval.value != 0:
            self.log_samples(state, logger)

    @torch.no_grad()
    def log_samples(self, state: State, logger: Logger) -> None:
        from diffusion.callbacks.live_pipeline import run_pipeline
        from diffusion.eval.sampling import sample, save

        with run_pipeline(state, self.tokenizers) as pipe:
            with torch.autocast(pipe.device.type, dtype=torch.bfloat16, enabled=pipe.device.type == "cuda"):
                images = sample(
                    pipe,
                    self.prompts,
                    steps=self.steps,
                    guidance_scale=self.guidance_scale,
                    image_size=self.image_size,
                    seed=self.seed,
                )
        if dist.get_global_rank() == 0:
            save(images, self.prompts, os.path.join(self.folder, f"ba{state.timestamp.batch.value}"))
            logger.log_images([np.asarray(im) for im in images], name="samples", channels_last=True)
