"""Synthetic data shaped like a model's real inputs, for throughput runs and tests.

A small pool of random samples is made once and indexed modulo its size, so a loader worker does no
work beyond collation and can never be what limits a GPU.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler

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


class SyntheticBuckets(Dataset):
    """Synthetic batches over aspect-ratio buckets (data/buckets.py): global batch k is one bucket's shape on
    every rank, the bucket drawn from (seed, k), so mixed-shape throughput is measured as bucketed training
    runs it. ``layouts``: each bucket's ``batch_shapes``; index i belongs to global batch i // global_batch."""

    def __init__(self, layouts: list[dict], global_batch: int, num_samples: int, seed: int = 0, pool: int = 4):
        self.global_batch, self.num_samples, self.seed = global_batch, num_samples, seed
        self.buckets = [SyntheticDataset(layout, num_samples=pool, pool=pool, seed=seed) for layout in layouts]

    def __len__(self) -> int:
        return self.num_samples - self.num_samples % self.global_batch

    def bucket(self, batch: int) -> int:
        return int(torch.randint(len(self.buckets), (1,), generator=torch.Generator().manual_seed(self.seed + batch)))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.buckets[self.bucket(index // self.global_batch)][index]


class RankSlices(Sampler):
    """Rank r's share of each global batch in order: indices k * G + r * B ... k * G + r * B + B - 1, so every
    rank's k-th batch is part of global batch k (one bucket)."""

    def __init__(self, dataset: SyntheticBuckets, rank: int, device_batch: int):
        self.dataset, self.rank, self.device_batch = dataset, rank, device_batch

    def __len__(self) -> int:
        return len(self.dataset) // self.dataset.global_batch * self.device_batch

    def __iter__(self):
        g, b = self.dataset.global_batch, self.device_batch
        for k in range(len(self.dataset) // g):
            yield from range(k * g + self.rank * b, k * g + self.rank * b + b)
