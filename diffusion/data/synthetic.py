"""Synthetic data shaped like a model's real inputs, for throughput runs and tests.

A small pool of random samples is made once and indexed modulo its size, so a loader worker does no
work beyond collation and can never be what limits a GPU.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from diffusion.batch import SAMPLE_ID


class SyntheticDataset(Dataset):
    """``num_samples`` samples drawn (cyclically) from ``pool`` distinct random ones.

    ``shapes`` maps a batch key to (shape, dtype, high): float keys are standard normal, integer keys
    uniform in [0, high), or in [low, high) when ``high`` is a pair (plausible image sizes, say). A model's
    ``batch_shapes(image_size, precomputed)`` gives its layout.
    """

    def __init__(
        self,
        shapes: dict[str, tuple],
        num_samples: int = 100_000,
        pool: int = 16,
        seed: int = 0,
        with_index: bool = False,
    ):
        g = torch.Generator().manual_seed(seed)
        self.num_samples = num_samples
        self.with_index = with_index  # add each sample's index as "sample_id" (validation sets)
        self.pool = [
            {
                key: (
                    torch.randint(*(high if isinstance(high, tuple) else (0, high)), shape, generator=g, dtype=dtype)
                    if not dtype.is_floating_point
                    else torch.randn(shape, generator=g, dtype=dtype)
                )
                for key, (shape, dtype, high) in shapes.items()
            }
            for _ in range(min(pool, num_samples))
        ]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.pool[index % len(self.pool)]
        return {**sample, SAMPLE_ID: torch.tensor(index)} if self.with_index else sample
