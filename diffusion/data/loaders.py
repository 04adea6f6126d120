"""Training and validation dataloaders: synthetic or MDS, online or precomputed, sharded across ranks."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

import torch
from composer.core import DataSpec
from composer.utils import dist
from streaming import StreamingDataLoader
from torch.utils.data import DataLoader, IterableDataset

from diffusion import object_store
from diffusion.batch import IMAGE, ORIGINAL_SIZE
from diffusion.config import prior_share
from diffusion.data import buckets, shards, shared_memory
from diffusion.data.filters import parse_filters
from diffusion.data.loader_workers import filter_stop_signals
from diffusion.data.synthetic import RankSlices, SyntheticBuckets, SyntheticDataset
from diffusion.data.transforms import to_unit_range
from diffusion.errors import UsageError, spell


@dataclass(frozen=True)
class DataSettings:
    """What the loaders read of a run, as plain values: the run's settings of the same names (``of``)."""

    model_name: str
    image_size: int
    precomputed_latents: bool
    seed: int
    num_workers: int
    use_synth_data: bool
    synthetic_samples: int
    synthetic_buckets: str | None
    eval_samples: int
    remote: str | None
    local: str | None
    eval_remote: str | None
    eval_local: str | None
    prior_remote: str | None
    prior_local: str | None
    prior_share: float  # resolved: its default where a prior is given without it
    filters: list[str]  # the training set's, as parse_filters reads them
    caption_dropout: float
    crop: str
    hflip: bool
    # Streaming's cache and download settings (None: Streaming's own default) and the sample order's one parameter
    # besides the seed (fixed, so that the order holds on any number of nodes and ranks)
    cache_limit: str | None
    predownload: int | None
    download_timeout: float | None
    download_retry: int | None
    num_canonical_nodes: int

    @classmethod
    def of(cls, settings) -> "DataSettings":
        """The values of the run's ``settings`` (a TrainConfig) under these names."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "prior_share"}
        return cls(**values, prior_share=prior_share(settings))


def loader_kwargs(num_workers: int, device_batch_size: int, drop_last: bool) -> dict:
    """A DataLoader's arguments; its workers (if any) are ended by their rank, not by a scheduler's stop signal
    (data/loader_workers.py)."""
    return dict(
        batch_size=device_batch_size,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        prefetch_factor=2 if num_workers > 0 else None,
        worker_init_fn=filter_stop_signals if num_workers > 0 else None,
    )


def _index(folder: str) -> str:
    return os.path.join(folder, "index.json")


def _mix_prior(remote, local, prior: tuple, bucketed: bool, where: str, options: dict) -> None:
    """``options`` for the two streams that mix the prior dataset (``prior``: its remote, local and share) into every
    batch of the dataset at ``where``; refused for a dataset bucketed by aspect ratio."""
    if bucketed:
        raise UsageError(
            f"{spell('prior_local')}/{spell('prior_remote')} mix a second dataset into every batch, and "
            f"{where} is bucketed by aspect ratio (each batch one bucket's shape); mix into a square dataset, or "
            "drop the prior dataset"
        )
    _check_location(prior[0], prior[1], "prior_local")
    prior_where = f"{spell(_naming_key(prior[0], 'prior_local'))} {prior[0] or prior[1]}"
    options.update(_prior_streams(remote, local, *prior), prior_where=prior_where)


def _refuse_image_options(options: dict) -> None:
    """A precomputed dataset has no images: the options that change images are refused (and taken out)."""
    image_only = {"caption_dropout": 0.0, "crop": "center", "hflip": False}
    used = [k for k, default in image_only.items() if options.pop(k, default) != default]
    if used:
        raise UsageError(
            f"{spell(used[0])} applies to images, and with {spell('precomputed_latents', 'true')} there are none (the "
            "captions are embeddings already; FLUX drops text conditioning with objective.text_dropout)"
        )


def streaming_dataset(
    *,
    remote: str | None,
    local: str | None,
    key: str,
    precomputed: bool,
    image_size: int,
    tokenizers: dict | None = None,
    expected: dict | None = None,
    prior: tuple[str | None, str | None, float] | None = None,
    **options,
):
    """An MDS dataset for training, validation, benchmarking or precomputing. ``key`` names the local
    location in messages: a config key (local, eval_local; the remote one is its twin) or a positional
    argument (SRC, DIR); ``expected``: the model's precomputed layout; ``prior``: (remote, local, share) of a
    second dataset mixed into every batch at that share (training);
    ``options`` go to the dataset (shuffle, batch_size, seed, filters, crop, hflip, caption_dropout...)."""
    from diffusion.data.streaming import StreamingImageCaptionDataset, StreamingLatentsDataset

    if dist.get_local_rank() == 0:  # a killed run's segments: a dozen descriptors each, or "Reused local directory"
        shared_memory.remove_stale()
    root = remote or local
    index = buckets.read_index(root, _naming_key(remote, key))  # buckets.json, read once: its buckets and counts
    aspects = None if index is None else [buckets.parse_name(n) for n in index["buckets"]]
    if aspects is None:
        _check_location(remote, local, key)
    where = f"{spell(_naming_key(remote, key))} {root}"
    if prior is not None:
        _mix_prior(remote, local, prior, aspects is not None, where, options)
        remote = local = None  # the two streams hold them
    workers = options.pop("workers", 0)
    if aspects is not None:
        aspects = _with_whole_batches(index.get("samples") or {}, aspects, where, workers, options)
        options.update(_bucket_streams(remote, local, aspects, image_size, options.pop("size_multiple", 8)))
        layout = options.pop("bucket_layout", None)  # the model's batch_shapes, for precomputed buckets
        if precomputed and layout is not None:
            options["bucket_expected"] = [layout(size, True) for size in options["bucket_sizes"]]
            options.pop("expected", None)
            expected = None
        remote = local = None
    else:
        options.pop("size_multiple", None)
        options.pop("bucket_layout", None)
    if precomputed:
        _refuse_image_options(options)
        return StreamingLatentsDataset(
            remote=remote, local=local, where=where, expected=expected, image_size=image_size, **options
        )
    return StreamingImageCaptionDataset(
        remote=remote, local=local, where=where, tokenizers=tokenizers or {}, image_size=image_size, **options
    )


def _with_whole_batches(counts: dict, aspects: list, where: str, workers: int, options: dict) -> list:
    """The buckets that give whole global batches on this run's nodes, ranks, loader workers and batch size
    (buckets.whole_global_batches); the others give none, so they are left out, with one line from rank 0 (Streaming
    raised on them, a numpy error on 3 or more nodes); none left is an error. ``counts``: buckets.json's samples
    per bucket."""
    names = [buckets.name(a) for a in aspects]
    if "batch_size" not in options or not all(n in counts for n in names):
        return aspects
    ranks = dist.get_local_world_size()
    nodes, batch = max(1, dist.get_world_size() // ranks), options["batch_size"]
    kept, out = buckets.usable(
        {n: counts[n] for n in names}, nodes, ranks, max(1, workers), batch, options.get("num_canonical_nodes") or nodes
    )
    if not out:
        return aspects
    said = (
        f"{where}: {', '.join(f'bucket {n} ({counts[n]:,} samples)' for n in out)} cannot fill one whole global "
        f"batch of {nodes * ranks * batch} ({nodes} node{'s' if nodes > 1 else ''} x {ranks} rank"
        f"{'s' if ranks > 1 else ''} x {spell('batch_size', batch)}) once Streaming splits it over the nodes, ranks "
        f"and {max(1, workers)} loader worker{'s' if workers > 1 else ''}"
    )
    if not kept:
        raise UsageError(
            f"{said}, and no bucket can: every epoch would be empty; lower {spell('batch_size')}, train on fewer "
            "nodes, or bucket more data (data.py bucket)"
        )
    if dist.get_global_rank() == 0:
        print(
            f"buckets: {said}: left out of this run (its samples are not read); lower {spell('batch_size')}, "
            "train on fewer nodes or add samples to keep it",
            file=sys.stderr,
            flush=True,
        )
    return [a for a, n in zip(aspects, names) if n in kept]


def _naming_key(remote: str | None, key: str) -> str:
    """The config key that names a dataset in messages: ``key`` (local, eval_local, prior_local), or its remote
    twin when the dataset is read from one."""
    return key.replace("local", "remote") if remote else key


def _check_location(remote: str | None, local: str | None, key: str) -> None:
    """An MDS dataset at ``remote`` (a URL is checked when read) or ``local``; else one line naming ``key``
    (local, eval_local, prior_local; the remote one is its twin)."""
    remote_key = key.replace("local", "remote")
    if remote and not object_store.is_remote(remote) and not os.path.isfile(_index(remote)):
        raise UsageError(
            f"{spell(remote_key)}: no MDS dataset at {remote!r} ({'no such folder' if not os.path.isdir(remote) else 'no index.json'}); "
            f"point it at converted shards (data.py convert) or a URL (s3://BUCKET/PATH)"
        )
    if remote is None and not os.path.isfile(_index(local or "")):
        raise UsageError(
            f"{spell(key)}: no MDS dataset at {local!r} (no index.json) and no "
            f"{spell(remote_key)} given; pass that, point {spell(key)} at converted shards "
            f"(data.py convert), or use {spell('use_synth_data', 'true')}"
        )


def _prior_streams(remote: str | None, local: str | None, prior_remote, prior_local, share: float) -> dict:
    """The run's dataset and its prior dataset as two Streaming streams in the shares 1 - share and share,
    batched stratified: every global batch holds exactly that many samples of each (the config checked that
    share x batch is whole). An epoch draws as many samples as the two hold together, in those shares."""
    from streaming import Stream

    streams = [
        Stream(remote=remote, local=local, proportion=1 - share),
        Stream(remote=prior_remote, local=prior_local, proportion=share),
    ]
    return {"streams": streams, "batching_method": "stratified", "bucket_root": remote or local}


def _bucket_streams(remote: str | None, local: str | None, aspects, image_size: int, multiple: int) -> dict:
    """A bucketed dataset as Streaming streams, one per bucket, batched per stream (every global batch from
    one bucket, so every rank holds the same shape), each with its pixel size at this resolution."""
    from streaming import Stream

    names = [buckets.name(a) for a in aspects]
    streams = [
        Stream(
            remote=buckets.location_of(remote, n) if remote else None, local=os.path.join(local, n) if local else None
        )
        for n in names
    ]
    sizes = [buckets.bucket_size(a, image_size, multiple) for a in aspects]
    return {"streams": streams, "batching_method": "per_stream", "bucket_sizes": sizes, "bucket_root": remote or local}


def token_lengths(model, image_size: int) -> dict[str, int]:
    """Token ids per caption for each id batch key, as the model's text encoders take them."""
    ids = set(model.TOKENIZERS.values())
    return {key: shape[0] for key, (shape, _, _) in model.batch_shapes(image_size, False).items() if key in ids}


def size_conditioning(model, image_size: int) -> bool:
    """Whether the model's image batches carry the original size and crop position (SDXL)."""
    return ORIGINAL_SIZE in model.batch_shapes(image_size, False)


def layout(model, columns=(), train: bool = True):
    """The model's ``batch_shapes`` for this run: on training batches, precomputed ones also carry what the run's
    techniques add (``columns``: functions of the image size -> {batch key: (shape, dtype, None)}; REPA's stored
    features)."""
    if not (train and columns):
        return model.batch_shapes

    def shapes(image_size, precomputed: bool) -> dict:
        found = model.batch_shapes(image_size, precomputed)
        if precomputed:
            for extra in columns:
                found.update(extra(image_size))
        return found

    return shapes


def _model_dataset(
    data: DataSettings, model, tokenizers, remote, local, key, device_batch_size, train: bool, columns=(), checks=()
):
    if not data.precomputed_latents:
        missing = set(model.TOKENIZERS.values()) - set(tokenizers)
        if missing:
            raise UsageError(
                f"{spell('model_name')} {data.model_name!r} has no tokenizer for {sorted(missing)}; pass "
                f"{spell('tokenizer', 'DIR')} or a pipeline directory with its tokenizer folders"
            )
    streaming = ("cache_limit", "predownload", "download_timeout", "download_retry")
    options = {key: getattr(data, key) for key in streaming if getattr(data, key) is not None}
    options["num_canonical_nodes"] = data.num_canonical_nodes
    if train:
        options.update(
            filters=parse_filters(data.filters), caption_dropout=data.caption_dropout, crop=data.crop, hflip=data.hflip
        )
        if data.prior_remote or data.prior_local:
            options["prior"] = (data.prior_remote, data.prior_local, data.prior_share)
    options["size_multiple"] = getattr(model, "size_multiple", 8)  # bucket sides (a bucketed dataset)
    shapes = layout(model, columns, train)
    if train and data.precomputed_latents:  # the dataset holds what the techniques add (REPA's record of its encoder)
        for check in checks:
            check(remote or local, key.replace("local", "remote") if remote else key, shards.read_document)
    options["bucket_layout"] = shapes  # each bucket's precomputed layout
    if not data.precomputed_latents:
        options["token_lengths"] = token_lengths(model, data.image_size)
        options["size_conditioning"] = size_conditioning(model, data.image_size)
    return streaming_dataset(
        remote=remote,
        local=local,
        key=key,
        precomputed=data.precomputed_latents,
        image_size=data.image_size,
        tokenizers=tokenizers,
        expected=shapes(data.image_size, True),
        shuffle=train,
        shuffle_seed=data.seed,
        seed=data.seed,
        batch_size=device_batch_size,
        with_index=not train,
        workers=data.num_workers,
        **options,
    )


def on_device(batch: dict) -> dict:
    """What the loaders leave to the device, applied by Composer to each microbatch once it is there:
    uint8 images -> [-1, 1], fp16 latents and embeddings -> fp32. Shipping the narrow types halves to
    quarters the bytes workers collate and copy to the GPU."""
    for key, value in batch.items():
        if key == IMAGE:
            batch[key] = to_unit_range(value)
        elif isinstance(value, torch.Tensor) and value.dtype == torch.float16:
            batch[key] = value.float()
    return batch


def _streaming_loader(dataset, kwargs: dict) -> DataSpec:
    return DataSpec(StreamingDataLoader(dataset, **kwargs), microbatch_transforms=on_device)


def build_train_dataloader(data: DataSettings, model, tokenizers: dict, device_batch_size: int, columns=(), checks=()):
    """Training data: synthetic or MDS. ``columns`` (functions of the image size -> {batch key: (shape, dtype,
    None)}) add to precomputed batches what the run's techniques read, and ``checks`` (each called with the dataset's
    root, the key naming it and data/shards.py's read_document) that an MDS dataset holds it."""
    kwargs = loader_kwargs(data.num_workers, device_batch_size, drop_last=True)
    if data.use_synth_data and data.synthetic_buckets:
        sizes = [
            buckets.bucket_size(buckets.parse_name(n), data.image_size, getattr(model, "size_multiple", 8))
            for n in buckets.names_of(data.synthetic_buckets)
        ]
        dataset = SyntheticBuckets(
            [layout(model, columns)(size, data.precomputed_latents) for size in sizes],
            global_batch=device_batch_size * dist.get_world_size(),
            num_samples=data.synthetic_samples,
            seed=data.seed,
        )
        sampler = RankSlices(dataset, dist.get_global_rank(), device_batch_size)
        return _one_batch_at_least(DataLoader(dataset, sampler=sampler, **kwargs), data.synthetic_samples, "synthetic")
    if data.use_synth_data:
        dataset = SyntheticDataset(
            layout(model, columns)(data.image_size, data.precomputed_latents),
            num_samples=data.synthetic_samples,
            seed=data.seed,
        )
        loader = DataLoader(dataset, sampler=dist.get_sampler(dataset, drop_last=True, shuffle=True), **kwargs)
        return _one_batch_at_least(loader, data.synthetic_samples, "synthetic")
    dataset = _model_dataset(
        data, model, tokenizers, data.remote, data.local, "local", device_batch_size, True, columns, checks
    )
    spec = _streaming_loader(dataset, kwargs)
    _one_batch_at_least(spec.dataloader, dataset.num_samples, dataset.where)
    return spec


def _one_batch_at_least(loader, samples: int, where: str):
    """``loader``, checked to give each rank at least one batch an epoch. An epoch without one is over before
    it starts, and Composer, which counts a run's length in batches, starts the next one forever."""
    if len(loader) > 0:
        return loader
    world = dist.get_world_size()
    per_rank = len(loader.dataset) if isinstance(loader.dataset, IterableDataset) else len(loader.sampler)
    global_batch = loader.batch_size * world
    what = f"{spell('synthetic_samples', samples)}" if where == "synthetic" else f"{where} has {samples:,} samples"
    raise UsageError(
        f"{what}, fewer than one global batch ({spell('batch_size', global_batch)} over {world} rank"
        f"{'s' if world > 1 else ''}, whole batches only): every epoch would be empty and the run would never end; "
        f"lower {spell('batch_size')} to {per_rank * world} or less, or train on more data"
    )


def build_eval_dataloader(data: DataSettings, model, tokenizers: dict, device_batch_size: int):
    """Validation data: MDS when --eval_local/--eval_remote is given, else a fixed synthetic set (with
    sample ids, so FLUX's MLPerf loss has fixed noise and timesteps per sample)."""
    kwargs = loader_kwargs(data.num_workers, device_batch_size, drop_last=False)
    if data.eval_local is None and data.eval_remote is None:
        dataset = SyntheticDataset(
            model.batch_shapes(data.image_size, data.precomputed_latents),
            num_samples=data.eval_samples,
            seed=data.seed + 1,
            with_index=True,
        )
        return DataLoader(dataset, sampler=dist.get_sampler(dataset, drop_last=False, shuffle=False), **kwargs)
    dataset = _model_dataset(
        data, model, tokenizers, data.eval_remote, data.eval_local, "eval_local", device_batch_size, False
    )
    return _streaming_loader(dataset, kwargs)
