"""The training dataloader: synthetic or MDS, online or precomputed, sharded across ranks."""
from __future__ import annotations

import os

import torch

from composer.utils import dist
from streaming import StreamingDataLoader
from torch.utils.data import DataLoader

from diffusion.data.synthetic import SyntheticDataset, synthetic_shapes
from diffusion.errors import UsageError


def build_train_dataloader(cfg, model, tokenizer, device_batch_size: int):
    loader_kwargs = dict(batch_size=device_batch_size, drop_last=True, num_workers=cfg.num_workers,
                         pin_memory=torch.cuda.is_available(), persistent_workers=cfg.num_workers > 0,
                         prefetch_factor=2 if cfg.num_workers > 0 else None)
    if cfg.use_synth_data:
        dataset = SyntheticDataset(synthetic_shapes(model, cfg.image_size, cfg.precomputed_latents),
                                   num_samples=cfg.synthetic_samples, seed=cfg.seed)
        sampler = dist.get_sampler(dataset, drop_last=True, shuffle=True)
        return DataLoader(dataset, sampler=sampler, **loader_kwargs)

    from diffusion.data.streaming import StreamingImageCaptionDataset, StreamingLatentsDataset
    if cfg.remote is None and not os.path.isfile(os.path.join(cfg.local, "index.json")):
        raise UsageError(f"--local: no MDS dataset at {cfg.local!r} (no index.json) and no --remote given; "
                         "pass --remote URL_OR_DIR, point --local at converted shards, or use --use_synth_data")
    common = dict(remote=cfg.remote, local=cfg.local, shuffle=True, batch_size=device_batch_size)
    if cfg.precomputed_latents:
        dataset = StreamingLatentsDataset(**common)
    else:
        if tokenizer is None:
            raise UsageError(f"--model_name {cfg.model_name!r} has no tokenizer; pass --tokenizer DIR")
        dataset = StreamingImageCaptionDataset(tokenizer=tokenizer, image_size=cfg.image_size, **common)
    return StreamingDataLoader(dataset, **loader_kwargs)
