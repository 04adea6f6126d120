"""Synthetic data shaped like a model's real inputs, for throughput runs and tests.

A small pool of random samples is made once and indexed modulo its size, so a loader worker does no
work beyond collation and can never be what limits a GPU.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from diffusion.models.sd import IMAGE, INPUT_IDS, LATENT_MOMENTS, TEXT_EMBEDS


class SyntheticDataset(Dataset):
    """``num_samples`` samples drawn (cyclically) from ``pool`` distinct random ones.

    ``shapes`` maps a batch key to (shape, dtype, high): float keys are standard normal, integer keys
    uniform in [0, high).
    """

    def __init__(self, shapes: dict[str, tuple], num_samples: int = 100_000, pool: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.num_samples = num_samples
        self.pool = [
            {key: (torch.randint(0, high, shape, generator=g, dtype=dtype) if not dtype.is_floating_point
                   else torch.randn(shape, generator=g, dtype=dtype))
             for key, (shape, dtype, high) in shapes.items()}
            for _ in range(min(pool, num_samples))
        ]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.pool[index % len(self.pool)]


def synthetic_shapes(model, image_size: int, precomputed_latents: bool) -> dict[str, tuple]:
    """Batch layout for ``model`` at ``image_size``: raw images and token ids, or latents + embeddings."""
    if precomputed_latents:
        h = image_size // model.vae_scale_factor
        return {
            LATENT_MOMENTS: ((2 * model.latent_channels, h, h), torch.float32, None),
            TEXT_EMBEDS: ((model.text_length, model.text_width), torch.float32, None),
        }
    return {
        IMAGE: ((3, image_size, image_size), torch.float32, None),
        INPUT_IDS: ((model.text_length,), torch.long, model.vocab_size),
    }
