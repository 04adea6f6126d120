"""Training and validation dataloaders: synthetic or MDS, online or precomputed, sharded across ranks."""
from __future__ import annotations

import os

import torch
from composer.utils import dist
from streaming import StreamingDataLoader
from torch.utils.data import DataLoader

from diffusion.data.synthetic import SyntheticDataset
from diffusion.errors import UsageError


def _loader_kwargs(cfg, device_batch_size: int, drop_last: bool) -> dict:
    return dict(batch_size=device_batch_size, drop_last=drop_last, num_workers=cfg.num_workers,
                pin_memory=torch.cuda.is_available(), persistent_workers=cfg.num_workers > 0,
                prefetch_factor=2 if cfg.num_workers > 0 else None)


def _streaming_dataset(cfg, model, tokenizers, remote, local, flag, device_batch_size, *, shuffle, with_index):
    """``flag`` names the pair of flags, e.g. "--local" (and "--remote")."""
    from diffusion.data.streaming import StreamingImageCaptionDataset, StreamingLatentsDataset
    if remote is None and not os.path.isfile(os.path.join(local or "", "index.json")):
        raise UsageError(f"{flag}: no MDS dataset at {local!r} (no index.json) and no "
                         f"{flag.replace('local', 'remote')} given; pass that, point {flag} at converted shards, "
                         "or use --use_synth_data")
    common = dict(remote=remote, local=local, shuffle=shuffle, batch_size=device_batch_size)
    if cfg.precomputed_latents:
        return StreamingLatentsDataset(with_index=with_index, **common)
    missing = set(model.TOKENIZERS.values()) - set(tokenizers)
    if missing:
        raise UsageError(f"--model_name {cfg.model_name!r} has no tokenizer for {sorted(missing)}; pass "
                         "--tokenizer DIR or a pipeline directory with its tokenizer folders")
    return StreamingImageCaptionDataset(tokenizers=tokenizers, image_size=cfg.image_size, **common)


def build_train_dataloader(cfg, model, tokenizers: dict, device_batch_size: int):
    kwargs = _loader_kwargs(cfg, device_batch_size, drop_last=True)
    if cfg.use_synth_data:
        dataset = SyntheticDataset(model.batch_shapes(cfg.image_size, cfg.precomputed_latents),
                                   num_samples=cfg.synthetic_samples, seed=cfg.seed)
        return DataLoader(dataset, sampler=dist.get_sampler(dataset, drop_last=True, shuffle=True), **kwargs)
    dataset = _streaming_dataset(cfg, model, tokenizers, cfg.remote, cfg.local, "--local",
                                 device_batch_size, shuffle=True, with_index=False)
    return StreamingDataLoader(dataset, **kwargs)


def build_eval_dataloader(cfg, model, tokenizers: dict, device_batch_size: int):
    """Validation data: MDS when --eval_local/--eval_remote is given, else a fixed synthetic set (with
    sample ids, so FLUX's MLPerf loss has fixed noise and timesteps per sample)."""
    kwargs = _loader_kwargs(cfg, device_batch_size, drop_last=False)
    if cfg.eval_local is None and cfg.eval_remote is None:
        dataset = SyntheticDataset(model.batch_shapes(cfg.image_size, cfg.precomputed_latents),
                                   num_samples=cfg.eval_samples, seed=cfg.seed + 1, with_index=True)
        return DataLoader(dataset, sampler=dist.get_sampler(dataset, drop_last=False, shuffle=False), **kwargs)
    dataset = _streaming_dataset(cfg, model, tokenizers, cfg.eval_remote, cfg.eval_local,
                                 "--eval_local", device_batch_size, shuffle=False, with_index=True)
    return StreamingDataLoader(dataset, **kwargs)
