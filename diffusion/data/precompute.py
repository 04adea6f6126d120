"""``data.py precompute``: an image-caption MDS dataset -> VAE posterior moments + text embeddings.

Runs the model's frozen encoders through ``model.precompute(batch)`` (so any family works: CLIP
embeddings for SD; T5 embeddings + CLIP pooled embedding for FLUX; both CLIP towers' hidden states, the pooled
embedding and the original size and crop position for SDXL) and stores the results in fp16 (sizes in int32) with
their shapes fixed in the column encodings, beside the source's key, caption and metadata. The VAE
moments (mean and log-variance) are stored rather than one latent sample, so training draws a fresh
posterior sample each time it sees the image (as MLPerf's Stable Diffusion reference does).

The source is cut into parts of ``part_size`` consecutive samples; under ``composer -n N`` rank r
writes parts r, r + N, ...; a re-run skips finished parts; rank 0 merges the index at the end.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from composer.utils import dist, reproducibility
from torch.utils.data import DataLoader, Dataset, default_collate

from diffusion import object_store
from diffusion.config import torch_dtype
from diffusion.data import shards
from diffusion.data.columns import IMAGE_COLUMNS, array_encoding
from diffusion.data.loaders import on_device, size_conditioning, streaming_dataset, token_lengths
from diffusion.errors import UsageError
from diffusion.models.build import FAMILIES, build_model, describe
from diffusion.progress import images_bar, wants_bar


class _ByIndex(Dataset):
    """Map-style view of a range of a streaming dataset, for a plain DataLoader with workers."""

    def __init__(self, dataset, ids: range):
        self.dataset, self.ids = dataset, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.dataset[self.ids[i]]


def _collate(samples: list):
    """Drops the samples the dataset could not decode (None); returns (batch or None, dropped)."""
    good = [s for s in samples if s is not None]
    if not good:
        return None, len(samples)
    meta = [s.pop("meta") for s in good]
    return {**default_collate(good), "meta": meta}, len(samples) - len(good)


def _stored(value: torch.Tensor) -> np.ndarray:
    """Features in fp16, sizes (SDXL's original size and crop position) in int32."""
    if value.is_floating_point():
        return value.float().cpu().numpy().astype(np.float16)
    return value.cpu().numpy().astype(np.int32)


def _rows(loader, model, device, bar, counts: dict):
    for batch, dropped in loader:
        counts["skipped"] += dropped
        bar.update(dropped)
        if batch is None:
            continue
        meta = batch.pop("meta")
        inputs = on_device({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        features = {k: _stored(v) for k, v in model.precompute(inputs).items()}
        for i, row in enumerate(meta):
            yield {**{k: v[i] for k, v in features.items()}, **row}
        counts["written"] += len(meta)
        bar.update(len(meta))


def precompute(
    src: str,
    out: str,
    *,
    model_name: str,
    image_size: int | None = None,
    batch_size: int = 32,
    num_workers: int = 4,
    encoder_dtype: str | None = None,
    tokenizer: str | None = None,
    local_parts: dict[str, str] | None = None,
    cache: str | None = None,
    part_size: int = 10_000,
    compression: str | None = None,
    shard_size: str = "64mb",
    seed: int = 17,
    progress: str | bool = "auto",
) -> dict:
    """``seed`` seeds the weights of a preset (random init): the default is training's, so a preset's
    precomputed encodings come from the very encoders ``benchmark.py --model_name PRESET`` builds.
    ``local_parts``: local pretrained parts replacing the model's (``{"vae": DIR, "text_encoder": DIR}``),
    the same ones training is given. ``progress``: auto, bar or lines (config.PROGRESS: a bar with images/s,
    or one line per finished part), or False for neither."""
    start = time.time()
    object_store.check(out, "OUT")
    world, rank = dist.get_world_size(), dist.get_global_rank()
    on_gpu = torch.cuda.is_available()
    if world > 1:
        dist.initialize_dist("gpu" if on_gpu else "cpu", timeout=24 * 3600.0)  # ranks finish at different times
    device = torch.device(f"cuda:{dist.get_local_rank()}" if on_gpu else "cpu")
    geometry = describe(model_name, local_parts=local_parts)
    family = FAMILIES[geometry.family]
    if not family.FROZEN:
        raise UsageError(
            f"--model_name {model_name} is {family.DESCRIPTION}, which has no frozen encoders to "
            "precompute; precompute with the diffusion model that will train on the latents (and "
            "--vae DIR for a trained autoencoder)"
        )
    image_size = image_size or geometry.resolution
    if image_size <= 0 or image_size % geometry.downsample_factor:
        raise UsageError(
            f"--image_size {image_size} must be a positive multiple of {geometry.downsample_factor} "
            f"for {model_name} (the size training will use)"
        )
    reproducibility.seed_all(seed)
    built = build_model(
        model_name, tokenizer_path=tokenizer, local_parts=local_parts, encoder_dtype=torch_dtype(encoder_dtype)
    )
    model = built.model.to(device).eval()

    remote, local = shards.source(src, cache)
    dataset = streaming_dataset(
        remote=remote,
        local=local,
        key="SRC",
        precomputed=False,
        image_size=image_size,
        tokenizers=built.tokenizers,
        token_lengths=token_lengths(model, image_size),
        size_conditioning=size_conditioning(model, image_size),
        substitute=False,
        shuffle=False,
    )
    keep = {c: e for c, e in dataset.columns.items() if c not in IMAGE_COLUMNS}
    dataset.passthrough = tuple(keep)
    columns = {
        k: array_encoding(shape, "float16" if dtype.is_floating_point else "int32")
        for k, (shape, dtype, _) in model.batch_shapes(image_size, True).items()
    }
    columns.update(keep)

    n = dataset.num_samples
    parts = {f"part-{p:05d}": range(p * part_size, min(n, (p + 1) * part_size)) for p in range(-(-n // part_size))}
    mine = list(parts)[rank::world]
    done = shards.finished_parts(out, mine, columns)
    todo = [name for name in mine if name not in done]
    total, show_bar, t0 = sum(len(parts[name]) for name in todo), bool(progress) and wants_bar(progress), time.time()
    bar = images_bar(total, f"precompute {model_name} {image_size}px", show_bar)
    counts = {"written": 0, "skipped": 0, "parts_done_before": len(done)}
    for name in todo:
        loader = DataLoader(
            _ByIndex(dataset, parts[name]),
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=_collate,
            pin_memory=on_gpu,
        )
        shards.write_part(
            out,
            name,
            columns,
            _rows(loader, model, device, bar, counts),
            compression=compression,
            shard_size=shard_size,
        )
        if progress and not show_bar and rank == 0:
            seen = counts["written"] + counts["skipped"]
            print(
                f"precompute: {name} done; {seen:,} of {total:,} images on rank 0 "
                f"({seen / max(time.time() - t0, 1e-9):.1f} images/s)",
                file=sys.stderr,
                flush=True,
            )
    bar.close()
    if world > 1:
        counts = {k: sum(c[k] for c in dist.all_gather_object(counts)) for k in counts}
        dist.barrier()
    report = {"model": model_name, "image_size": image_size, "columns": columns, "parts": len(parts), **counts}
    if rank == 0:
        index = shards.merge_parts(out, list(parts))
        report.update(dataset_samples=shards.index_samples(index), seconds=round(time.time() - start, 1))
        print(
            f"precompute: {counts['written']:,} samples encoded with {model_name} at {image_size} px into {out} "
            f"in {report['seconds']} s ({counts['skipped']} skipped: images that do not decode; "
            f"{counts['parts_done_before']} of {len(parts)} parts done before, skipped); the dataset "
            f"has {report['dataset_samples']:,} samples; columns: " + ", ".join(f"{c} {e}" for c, e in columns.items())
        )
    return report
