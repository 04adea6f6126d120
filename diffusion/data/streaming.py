"""MDS (MosaicML Streaming) datasets for training: image-caption and precomputed latents.

Both are ``StreamingDataset``s, so remote + local cache, shuffling, partitioning over ranks and nodes and
mid-epoch resumption (``StreamingDataLoader.state_dict``, carried in Composer checkpoints) come from
Streaming. What they add, shared by both:

* schema checks when built (columns present, every shard alike, filters on existing columns; latents
  shaped for the model), each a one-line ``UsageError`` naming the dataset;
* metadata filters (``pwatermark<=0.5``) and bad samples (an image that does not decode) are replaced
  by the next sample that passes. The replacement is a pure function of the sample index, so every rank
  still yields exactly its share of batches (no rank waits on another at the end of an epoch) and
  resumption stays exact. Bad samples are counted and logged, filtered ones counted;
* randomness (crop position, flip, caption dropout) is drawn from (seed, epoch, index): a resumed run
  sees exactly the samples an uninterrupted one would.

Image-caption samples: ``image`` (3, S, S) uint8 (the loader's DataSpec scales it to [-1, 1] on the
device) and token ids per tokenizer the model has (CLIP ids for SD; CLIP and T5 ids for FLUX; two CLIP
tokenizers' ids for SDXL), and for models conditioned on size and crop (SDXL) ``original_size`` (from the
``original_height``/``original_width`` columns, else the stored image's size) and ``crop_top_left`` (from the
crop the transform made), as batch.py defines them.
Latent samples: ``latent_moments`` (2C, h, w) (or ``latents``), ``text_embeds`` and, for FLUX and SDXL,
``pooled_text_embeds``, as stored (fp16; fp32 on the device), and SDXL's ``original_size`` and
``crop_top_left`` (int32); the model samples the posterior.
"""

from __future__ import annotations

import os
import struct
import time
import warnings

import numpy as np
import torch
from streaming import StreamingDataset
from streaming.base.constant import TICK
from streaming.base.dataset import _ShardState

from diffusion import object_store
from diffusion.batch import (
    CROP_TOP_LEFT,
    IMAGE,
    LATENT_MOMENTS,
    LATENTS,
    ORIGINAL_SIZE,
    POOLED_TEXT_EMBEDS,
    SAMPLE_ID,
    TEXT_EMBEDS,
    TIMESTEP_INDEX,
)
from diffusion.config import CROPS
from diffusion.data.bad_samples import BadSample, SkipCounter, describe_error
from diffusion.data.caption_ids import CaptionIds
from diffusion.data.columns import (
    CAPTION_COLUMNS,
    IMAGE_COLUMNS,
    KEY,
    ORIGINAL_HEIGHT,
    ORIGINAL_WIDTH,
    dataset_columns,
    find_column,
)
from diffusion.data.filters import check_filter_columns, passes
from diffusion.data.shards import check_remote_shards, check_shards, opening_dataset
from diffusion.data.transforms import ImageTransform
from diffusion.errors import UsageError, spell

MAX_SCAN = 10_000  # samples looked at to replace one filtered-out or bad sample before giving up


# Streaming's words when one of a dataset's threads failed: with the thread's error (streaming-community's __iter__),
# or without it (its get_item, and a waiter here)
THREAD_FAILED = "Background thread failed. Check other traceback."
STREAMING_FAILED = ("StreamingDataset background thread failed", THREAD_FAILED)


class _MDSDataset(StreamingDataset):
    def __init__(
        self,
        *,
        filters=(),
        seed: int = 0,
        with_index: bool = False,
        substitute: bool = True,
        where: str | None = None,
        **streaming_kwargs,
    ):
        # a dataset read as streams (one per bucket, or the run's and its prior): the run's dataset, for messages
        root = streaming_kwargs.pop("bucket_root", None)
        self.prior_where = streaming_kwargs.pop("prior_where", None)  # a mixed one: the run's stream, the prior's
        self.where = where or f"MDS dataset {streaming_kwargs.get('remote') or streaming_kwargs.get('local') or root}"
        self.remote_url = streaming_kwargs.get("remote") or (root if object_store.is_remote(root) else None)
        remotes = [self.remote_url, *(stream.remote for stream in streaming_kwargs.get("streams") or ())]
        if any(object_store.is_remote(r) for r in remotes):  # ride out a store restarting
            streaming_kwargs.setdefault("download_retry", object_store.download_attempts())
        with opening_dataset(self.where):
            super().__init__(**streaming_kwargs)
        check_shards(self.shards, self.where)
        per_stream = [
            [sh for sh, s in zip(self.shards, self.stream_per_shard) if s == i] for i in range(len(self.streams))
        ]
        # one schema per stream: the buckets of a precomputed bucketed dataset differ in their arrays' shapes
        self.columns = [dataset_columns(own, self.where) for own in per_stream if own][0]
        self.prior_columns = dataset_columns(per_stream[1], self.prior_where) if self.prior_where else None
        for stream, own in zip(self.streams, per_stream):
            check_remote_shards(own, stream.remote if len(self.streams) > 1 else self.remote_url, self.where)
        self.filters = list(filters)
        check_filter_columns(self.filters, self.columns, self.where)
        self.seed = seed
        self.with_index = with_index  # add "sample_id" (validation: fixed noise per sample)
        self.substitute = substitute  # False: a bad sample gives None (precompute skips it)
        self.skipped = SkipCounter()
        self.filtered = 0
        self._epoch = 0

    def _check_prior_columns(self, read) -> None:
        """A mixed dataset's prior holds every column the run reads from its own (``read``); else one line."""
        if self.prior_columns is None:
            return
        missing = [c for c in read if c and c not in self.prior_columns]
        if missing:
            raise UsageError(
                f"{self.prior_where} has no {', '.join(repr(c) for c in missing)} column, which the run reads from "
                f"{self.where} (the prior has {', '.join(self.prior_columns)}); write it as the run's dataset was "
                "written (data.py convert, or precompute with the same model), or drop the filter that reads it"
            )

    def _prepare_thread(self, it) -> None:
        """Streaming's shard-download thread; none when every shard is on disk (``_all_local``)."""
        if self._all_local():
            it.prepare_index = it.total
            it.on_exit()
            return
        super()._prepare_thread(it)

    def _ready_thread(self, it) -> None:
        """Streaming's ready thread, which downloads a shard it finds not yet asked for; every sample is ready at
        once when every shard is on disk (``_all_local``)."""
        if self._all_local():
            it.ready_index = it.total
            it.on_exit()
            return
        super()._ready_thread(it)

    def _all_local(self) -> bool:
        """Every shard on local disk, decompressed, and no cache limit that could evict one: then Streaming's two
        epoch threads have nothing to do but poll. They took a file lock for every sample and woke every 7 ms
        (its TICK) to see whether the loader had caught up: 13% of the training loop's samples in a profile of
        sd-tiny on 2 cores (docs/performance.md, 2026-11-28), a third thread taking the GIL and a core from
        the model's two. Checked at each epoch's start, per loader worker (a stat per shard)."""
        if self.cache_limit:
            return False
        for shard_id, shard in enumerate(self.shards):
            if self._shard_states[shard_id] != _ShardState.LOCAL:
                return False
            stream = self.streams[self.stream_per_shard[shard_id]]
            if not os.path.isfile(os.path.join(stream.local, stream.split or "", shard.file_pairs[0][0].basename)):
                return False
        return True

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """Streaming's, which puts a shard whose download failed back to REMOTE (streaming-community; 0.13 left it
        PREPARING and its waiters waited forever), with the download's own error kept for ``__iter__``'s line
        (Streaming keeps only a background thread's, and a download can fail in the iterating thread too) and
        this process's threads told at once: a waiter here stops as "Background thread failed" instead of
        trying the store again once for every sample of the shard."""
        while blocking and self._shard_states[shard_id] == _ShardState.PREPARING and not self._failed():
            time.sleep(TICK)
        if self._failed():
            raise RuntimeError(THREAD_FAILED)
        try:
            super().prepare_shard(shard_id, blocking)
        except Exception as e:
            if getattr(self, "download_error", None) is None:
                self.download_error = e
            if hasattr(self, "_event"):
                self._event.set()
            raise

    def _failed(self) -> bool:
        return hasattr(self, "_event") and self._event.is_set()

    def __iter__(self):
        """Streaming's iteration; a shard download that failed for good (the store down past
        ``download_retry``'s backoff, set from OBJECT_STORE_RETRY_SECONDS) is one line naming the dataset, in the
        epoch it failed in (streaming-community raises it there; 0.13 ended the epoch early without a word)."""
        try:
            yield from super().__iter__()
        except ValueError as e:  # per_stream batching (aspect-ratio buckets): no bucket as large as a batch
            if "No stream has an adequate number" not in str(e):
                raise
            raise UsageError(
                f"{self.where}: no bucket has as many samples as one global batch ({spell('batch_size')}); lower "
                "the batch size, or bucket more data (data.py bucket)"
            ) from None
        except Exception as e:  # noqa: BLE001 - the download's own error, or Streaming's word for it
            error = getattr(self, "download_error", None) or getattr(self, "_background_error", None)
            if error is None or not (e is error or any(words in str(e) for words in STREAMING_FAILED)):
                raise
            raise UsageError(
                f"{self.where}: a shard download failed: {object_store.problem(error, self.remote_url or '')}; "
                "run the same command once the store answers (training resumes from its last checkpoint)"
            ) from None

    def _get_work(self, epoch: int, sample_in_epoch: int):
        self._epoch = epoch  # the epoch this worker iterates, for per-sample randomness
        return super()._get_work(epoch, sample_in_epoch)

    def sample_location(self, index: int) -> str:
        shard_id, offset = self.spanner[index]
        return f"{self.where}, shard {self.shards[shard_id].raw_data.basename}, sample {index} (#{offset} in shard)"

    def stream_of(self, index: int) -> int:
        """The stream a sample comes from (a bucketed dataset: its bucket)."""
        return int(self.stream_per_shard[self.spanner[index][0]])

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, self._epoch, index))

    def make(self, sample: dict, index: int) -> dict:
        raise NotImplementedError

    def read(self, index: int) -> dict:
        """``get_item``, with a shard that cannot be read (cut short after ``check_shards`` looked, e.g. a
        download cut short) raised as a BadSample naming the shard's file: skipped and counted like a bad
        image, so one damaged shard costs its samples, not the run."""
        try:
            return self.get_item(index)
        except (IndexError, ValueError, EOFError, struct.error) as e:
            shard = self.shards[self.spanner[index][0]]
            path = os.path.join(shard.dirname, shard.split, shard.raw_data.basename)
            raise BadSample("unreadable shard", f"{path}: {describe_error(e)}") from None

    def __getitem__(self, index: int):
        """The sample at ``index``, or the first one after it that passes the filters and decodes. Counts
        and logs are of the sample at ``index`` only, so each sample is counted once per epoch."""
        index = int(index)
        scan = min(MAX_SCAN, self.num_samples)
        for step in range(scan):
            j = (index + step) % self.num_samples
            sample = {}
            try:
                sample = self.read(j)
                if not passes(self.filters, sample):
                    self.filtered += step == 0
                    if not self.substitute:
                        return None
                    continue
                out = self.make(sample, index)
            except BadSample as e:
                if step == 0:
                    key = f" key {sample[KEY]!r}" if KEY in sample else ""
                    self.skipped.add(e.reason, self.sample_location(j) + key, e.detail)
                if not self.substitute:
                    return None
                continue
            if self.with_index:
                out[SAMPLE_ID] = torch.tensor(index)
            return out
        raise UsageError(
            f"{self.sample_location(index)}: none of the {scan} samples from here on passes "
            f"the filters ({', '.join(map(str, self.filters)) or 'none'}) and decodes; loosen the "
            "filters, or filter when converting (data.py convert --filter)"
        )


class StreamingImageCaptionDataset(_MDSDataset):
    """Images + captions, tokenized once per tokenizer (batch key -> tokenizer)."""

    def __init__(
        self,
        *,
        tokenizers: dict,
        image_size: int,
        bucket_sizes: list[tuple[int, int]] | None = None,
        crop: str = "center",
        hflip: bool = False,
        caption_dropout: float = 0.0,
        token_lengths: dict | None = None,
        passthrough: tuple[str, ...] = (),
        size_conditioning: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.image_column = find_column(self.columns, IMAGE_COLUMNS)
        self.caption_column = find_column(self.columns, CAPTION_COLUMNS)
        for column, names in ((self.image_column, IMAGE_COLUMNS), (self.caption_column, CAPTION_COLUMNS)):
            if column is None:
                raise UsageError(
                    f"{self.where} is not an image-caption dataset: it has no "
                    f"{'/'.join(names)} column (columns: {', '.join(self.columns)})"
                    + ("; for precomputed latents pass --precomputed_latents" if TEXT_EMBEDS in self.columns else "")
                )
        if not 0.0 <= caption_dropout < 1.0:
            raise UsageError(f"--caption_dropout {caption_dropout} must be in [0, 1)")
        if crop not in CROPS:
            raise UsageError(f"--crop {crop!r} is not one of {', '.join(CROPS)}")
        self.tokenizers = tokenizers
        # ids per batch key: the model's text lengths (FLUX: T5 max_sequence_length), else the tokenizer's
        self.token_lengths = {k: (token_lengths or {}).get(k, tok.model_max_length) for k, tok in tokenizers.items()}
        self.caption_ids = {k: CaptionIds(tok, self.token_lengths[k]) for k, tok in tokenizers.items()}
        # one transform per stream: a bucket's (height, width), or the square image_size
        self.transforms = [ImageTransform(size, crop=crop, hflip=hflip) for size in bucket_sizes or [image_size]]
        self.caption_dropout = caption_dropout
        self.passthrough = passthrough  # columns returned as they are under "meta" (precompute)
        self.size_conditioning = size_conditioning  # add ORIGINAL_SIZE and CROP_TOP_LEFT (SDXL)
        self.original_size_columns = ORIGINAL_HEIGHT in self.columns and ORIGINAL_WIDTH in self.columns
        sizes = (ORIGINAL_HEIGHT, ORIGINAL_WIDTH) if self.original_size_columns else ()
        self._check_prior_columns([self.image_column, self.caption_column, *sizes, *(f.column for f in self.filters)])

    def make(self, sample: dict, index: int) -> dict:
        rng = self.rng(index)
        caption = sample[self.caption_column]
        if self.caption_dropout and rng.random() < self.caption_dropout:
            caption = ""  # unconditional, for classifier-free guidance
        transform = self.transforms[self.stream_of(index) if len(self.transforms) > 1 else 0]
        cropped = transform(sample[self.image_column], rng)
        out = {IMAGE: cropped.pixels}
        if self.size_conditioning:
            original = (
                (int(sample[ORIGINAL_HEIGHT]), int(sample[ORIGINAL_WIDTH]))
                if self.original_size_columns
                else cropped.stored_size
            )
            out[ORIGINAL_SIZE] = torch.tensor(original)
            out[CROP_TOP_LEFT] = torch.tensor(cropped.crop_top_left)
        for key, ids in self.caption_ids.items():
            out[key] = ids(caption)
        if self.passthrough:
            out["meta"] = {c: sample[c] for c in self.passthrough}
        return out


class StreamingLatentsDataset(_MDSDataset):
    """Precomputed VAE posterior moments (or latents) and text embeddings. ``expected`` (a model's
    ``batch_shapes(image_size, precomputed=True)``) is checked against the first sample."""

    def __init__(
        self,
        *,
        expected: dict | None = None,
        image_size: int | None = None,
        bucket_expected: list[dict] | None = None,
        **kwargs,
    ):
        kwargs.pop("bucket_sizes", None)  # a bucketed dataset's pixel sizes: its latents have them already
        super().__init__(**kwargs)
        self.keys = [
            k
            for k in (
                LATENT_MOMENTS,
                LATENTS,
                TEXT_EMBEDS,
                POOLED_TEXT_EMBEDS,
                ORIGINAL_SIZE,
                CROP_TOP_LEFT,
                TIMESTEP_INDEX,
            )
            if k in self.columns
        ]
        # what the run's techniques add to its batches (REPA's stored features): read only when asked, as they are large
        asked = {key for shapes in [expected or {}, *(bucket_expected or [])] for key in shapes}
        self.keys += sorted(key for key in asked if key in self.columns and key not in self.keys)
        if TEXT_EMBEDS not in self.columns or not {LATENT_MOMENTS, LATENTS} & self.columns.keys():
            raise UsageError(
                f"{self.where} is not a precomputed dataset: it needs '{TEXT_EMBEDS}' and "
                f"'{LATENT_MOMENTS}' or '{LATENTS}' columns, it has {', '.join(self.columns)}"
                + (
                    "; it holds images: drop --precomputed_latents or run data.py precompute"
                    if find_column(self.columns, IMAGE_COLUMNS)
                    else ""
                )
            )
        if bucket_expected:  # one layout per bucket, checked on each bucket's first sample
            for stream_id, layout in enumerate(bucket_expected):
                self._check_shapes(layout, image_size, int(self.sample_offset_per_stream[stream_id]))
        elif expected:
            self._check_shapes(expected, image_size)
        self._check_prior_columns([*self.keys, *(f.column for f in self.filters)])
        if expected and self.prior_columns is not None:  # the prior's arrays shaped as the run's
            self._check_shapes(expected, image_size, int(self.sample_offset_per_stream[1]), self.prior_where)

    def _check_shapes(self, expected: dict, image_size: int | None, index: int = 0, where: str | None = None) -> None:
        where = where or self.where
        first = self.make(self.get_item(index), index)
        for key, (shape, _, _) in expected.items():
            if key == LATENT_MOMENTS and key not in first:
                key, shape = LATENTS, (shape[0] // 2, *shape[1:])
            if key not in first:
                raise UsageError(
                    f"{where} has no '{key}' column, which this run reads (columns: {', '.join(self.columns)}); "
                    "precompute with this model and the run's techniques (data.py precompute)"
                )
            got, shape = tuple(first[key].shape), tuple(shape)
            if got == shape:
                continue
            hint = "; precompute with this model (data.py precompute)"
            if key in (LATENT_MOMENTS, LATENTS) and got[0] == shape[0] and image_size and got[1] != shape[1]:
                hint = (
                    f"; they were precomputed for {image_size * got[1] // shape[1]}-px images: pass "
                    f"--image_size {image_size * got[1] // shape[1]}"
                )
            raise UsageError(
                f"{where}: '{key}' is {list(got)} per sample, this model at "
                f"{image_size or 'this'} px needs {list(shape)}{hint}"
            )

    def make(self, sample: dict, index: int) -> dict:
        out = {}
        with warnings.catch_warnings():  # MDS arrays are read-only views of the sample's bytes; only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for key in self.keys:
                if key == TIMESTEP_INDEX:
                    out[key] = torch.tensor(int(sample[key]))
                else:  # as stored (fp16, fp32 on the device; int32 sizes), no copy: collation copies it once, into the batch
                    out[key] = torch.from_numpy(sample[key])
        return out
