"""``data.py precompute``: an image-caption MDS dataset -> VAE posterior moments + text embeddings.

Runs the model's frozen encoders through ``model.precompute(batch)`` (so any family works: CLIP
embeddings for SD; T5 embeddings + CLIP pooled embedding for FLUX; both CLIP towers' hidden states, the pooled
embedding and the original size and crop position for SDXL) and stores the results in fp16 (sizes in int32) with
their shapes fixed in the column encodings, beside the source's key, caption and metadata. The VAE
moments (mean and log-variance) are stored rather than one latent sample, so training draws a fresh
posterior sample each time it sees the image (as MLPerf's Stable Diffusion reference does). A training technique
given its precompute keys stores its own columns too (``Technique.store``; REPA with ``repa_encoder``: the frozen
vision encoder's patch features, fp16, on the encoder's own grid for each bucket's size, with OUT's record of the
encoder).

The source is cut into parts of ``part_size`` consecutive samples; under ``composer -n N`` rank r
writes parts r, r + N, ...; a re-run skips finished parts; rank 0 merges the index at the end.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from composer.utils import dist, reproducibility
from torch.utils.data import DataLoader, Dataset, default_collate

from diffusion import object_store
from diffusion.batch import IMAGE
from diffusion.data import buckets, shards, shared_memory
from diffusion.data.columns import IMAGE_COLUMNS, array_encoding
from diffusion.data.loaders import on_device, size_conditioning, streaming_dataset, token_lengths
from diffusion.errors import UsageError
from diffusion.models.build import FAMILIES, build_model, describe
from diffusion.progress import images_bar, wants_bar
from diffusion.settings import torch_dtype
from diffusion.techniques import TECHNIQUES

STORED_KEYS = tuple(key for t in TECHNIQUES for key in t.PRECOMPUTE)  # the techniques' keys precompute takes


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


def _rows(loader, model, stores: list, device, bar, counts: dict):
    for batch, dropped in loader:
        counts["skipped"] += dropped
        bar.update(dropped)
        if batch is None:
            continue
        meta = batch.pop("meta")
        inputs = on_device({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        features = {k: _stored(v) for k, v in model.precompute(inputs).items()}
        for store in stores:
            features.update(store.rows(inputs[IMAGE]))
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
    tokenizers: dict[str, str] | None = None,
    local_parts: dict[str, str] | None = None,
    cache: str | None = None,
    part_size: int = 10_000,
    compression: str | None = None,
    shard_size: str = "64mb",
    seed: int = 17,
    progress: str | bool = "auto",
    **stored: str | None,
) -> dict:
    """``seed`` seeds the weights of a preset (random init): the default is training's, so a preset's
    precomputed encodings come from the very encoders ``benchmark.py --model_name PRESET`` builds.
    ``local_parts``: local pretrained parts replacing the model's (``{"vae": DIR, "text_encoder": DIR}``),
    and ``tokenizers`` its tokenizers (``{"tokenizer": DIR}``), the same ones training is given.
    ``progress``: one of config.PROGRESS (a bar with images/s, or one line per finished part: lines and
    metrics alike), or False for neither. ``stored``: the training techniques' precompute keys (``STORED_KEYS``;
    ``repa_encoder``: a vision encoder whose patch features are stored too, for REPA on these latents)."""
    start = time.time()
    object_store.check(out, "OUT")
    world, rank, device = _start_ranks()
    image_size = _checked_image_size(model_name, image_size, local_parts)
    stores = _stores(stored, encoder_dtype, out, rank, device)
    reproducibility.seed_all(seed)
    built = build_model(
        model_name, tokenizers=tokenizers, local_parts=local_parts, encoder_dtype=torch_dtype(encoder_dtype)
    )
    model = built.model.to(device).eval()
    run = dict(
        model=model,
        tokenizers=built.tokenizers,
        device=device,
        cache=cache,
        batch_size=batch_size,
        num_workers=num_workers,
        part_size=part_size,
        compression=compression,
        shard_size=shard_size,
        progress=progress,
        label=model_name,
        stores=stores,
    )
    index = buckets.read_index(src)
    if index is None:
        return _encode(src, out, image_size, start, **run)
    reports = _encode_buckets(src, out, index["buckets"], image_size, start, rank, run)
    return {"model": model_name, "image_size": image_size, "buckets": reports}


def _stores(stored: dict, encoder_dtype: str | None, out: str, rank: int, device) -> list:
    """What the techniques store beside the latents, each once OUT is known to hold no other kind of it (rank 0
    records each in OUT before any part is written)."""
    unknown = set(stored) - set(STORED_KEYS)
    if unknown:
        raise TypeError(f"precompute() got unexpected keys {sorted(unknown)}; the techniques' are {STORED_KEYS}")
    write = shards.write_document if rank == 0 else lambda *_: None
    stores = []
    for technique in TECHNIQUES:
        given = {key: stored.get(key) for key in technique.PRECOMPUTE} | {"encoder_dtype": encoder_dtype}
        store = technique.store(given, out, shards.read_document, write) if technique.PRECOMPUTE else None
        if store is not None:
            stores.append(store.to(device))
    return stores


def _encode_buckets(src: str, out: str, names: list[str], image_size: int, start: float, rank: int, run: dict):
    """A bucketed dataset (data.py bucket): each bucket encoded at its own size into the same bucket of OUT,
    whose buckets.json rank 0 writes last; the report of each bucket."""
    reports = {}
    for name in names:
        size = buckets.bucket_size(buckets.parse_name(name), image_size, run["model"].size_multiple)
        cache = os.path.join(run["cache"], name) if run["cache"] else None
        reports[name] = _encode(
            buckets.location_of(src, name), buckets.location_of(out, name), size, start, **{**run, "cache": cache}
        )
        dist.barrier()  # every rank done with this bucket's dataset: its shared memory can go
        shared_memory.release_own()
    if rank == 0:
        buckets.write_buckets_file(
            out, {buckets.parse_name(n): r.get("dataset_samples", 0) for n, r in reports.items()}
        )
    return reports


def _encode(
    src: str,
    out: str,
    image_size: int | tuple[int, int],
    start: float,
    *,
    model,
    tokenizers: dict,
    device,
    cache: str | None,
    batch_size: int,
    num_workers: int,
    part_size: int,
    compression: str | None,
    shard_size: str,
    progress,
    label: str,
    stores: list,
) -> dict:
    """One MDS dataset's samples through the model's frozen encoders into OUT's parts (this rank's share)."""
    model_name = label
    world, rank = dist.get_world_size(), dist.get_global_rank()
    dataset, columns = _source_dataset(src, cache, model, tokenizers, image_size, stores)
    parts = _parts(dataset.num_samples, part_size)
    mine = list(parts)[rank::world]
    done = shards.finished_parts(out, mine, columns)
    todo = [name for name in mine if name not in done]
    total, show_bar, t0 = sum(len(parts[name]) for name in todo), bool(progress) and wants_bar(progress), time.time()
    size = f"{image_size}px" if isinstance(image_size, int) else f"{image_size[1]}x{image_size[0]}px"
    bar = images_bar(total, f"precompute {model_name} {size}", show_bar)
    counts = {"written": 0, "skipped": 0, "parts_done_before": len(done)}
    for name in todo:
        loader = DataLoader(
            _ByIndex(dataset, parts[name]),
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=_collate,
            pin_memory=device.type == "cuda",
        )
        rows = _rows(loader, model, stores, device, bar, counts)
        shards.write_part(out, name, columns, rows, compression=compression, shard_size=shard_size)
        if progress and not show_bar and rank == 0:
            _print_part_done(name, counts["written"] + counts["skipped"], total, t0)
    bar.close()
    if world > 1:  # every rank's counts, once every rank has written its parts
        counts = {k: sum(c[k] for c in dist.all_gather_object(counts)) for k in counts}
        dist.barrier()
    report = {"model": model_name, "image_size": image_size, "columns": columns, "parts": len(parts), **counts}
    if rank == 0:
        _merge(out, list(parts), report, start)
    return report


def _start_ranks() -> tuple[int, int, torch.device]:
    """(world size, global rank, this rank's device); under ``composer -n N`` the process group, with a
    day's timeout: ranks finish their parts at different times."""
    world, rank = dist.get_world_size(), dist.get_global_rank()
    on_gpu = torch.cuda.is_available()
    if world > 1:
        dist.initialize_dist("gpu" if on_gpu else "cpu", timeout=24 * 3600.0)
    return world, rank, torch.device(f"cuda:{dist.get_local_rank()}" if on_gpu else "cpu")


def _print_part_done(name: str, seen: int, total: int, t0: float) -> None:
    print(
        f"precompute: {name} done; {seen:,} of {total:,} images on rank 0 "
        f"({seen / max(time.time() - t0, 1e-9):.1f} images/s)",
        file=sys.stderr,
        flush=True,
    )


def _checked_image_size(model_name: str, image_size: int | None, local_parts: dict[str, str] | None) -> int:
    """The image size to encode at (the model's resolution by default), once the model is known to have
    frozen encoders and the size to fit its downsampling; from configs alone, before any weight is built."""
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
    return image_size


def _source_dataset(src: str, cache: str | None, model, tokenizers: dict, image_size, stores: list):
    """The source read in order, without substitutes, its non-image columns passed through; and the output
    columns: the model's precomputed batch keys, the techniques' stored ones, then the passed-through ones."""
    remote, local = shards.source(src, cache)
    dataset = streaming_dataset(
        remote=remote,
        local=local,
        key="SRC",
        precomputed=False,
        image_size=image_size,
        tokenizers=tokenizers,
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
    for store in stores:
        columns.update({k: array_encoding(shape, dtype) for k, (shape, dtype) in store.columns(image_size).items()})
    columns.update(keep)
    return dataset, columns


def _parts(n: int, part_size: int) -> dict[str, range]:
    """Output part name -> the source samples it holds (``part_size`` consecutive ones)."""
    return {f"part-{p:05d}": range(p * part_size, min(n, (p + 1) * part_size)) for p in range(-(-n // part_size))}


def _merge(out: str, parts: list[str], report: dict, start: float) -> None:
    """Rank 0: the parts' indexes merged into ``out``'s, and the report completed and printed."""
    index = shards.merge_parts(out, parts)
    report.update(dataset_samples=shards.index_samples(index), seconds=round(time.time() - start, 1))
    print(
        f"precompute: {report['written']:,} samples encoded with {report['model']} at {report['image_size']} px "
        f"into {out} in {report['seconds']} s ({report['skipped']} skipped: images that do not decode; "
        f"{report['parts_done_before']} of {report['parts']} parts done before, skipped); the dataset "
        f"has {report['dataset_samples']:,} samples; columns: "
        + ", ".join(f"{c} {e}" for c, e in report["columns"].items())
    )
