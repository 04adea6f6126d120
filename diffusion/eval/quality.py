"""Image quality of a text-to-image model: FID against reference images or statistics, and CLIP score, on
the images it generates for a prompts file (MLPerf SD: 30k COCO-2014 validation captions).

Work is split over ranks by batch: batch b (prompts b*batch_size ...) is sampled by rank b % world_size,
each image with its own seed (seed + prompt index), so the images do not depend on the world size. The
metrics' states (feature sums, score sums) are summed over ranks by torchmetrics at ``compute``; every
rank gets the same figures. Used by evaluate.py and by the QualityEval training callback.
"""

from __future__ import annotations

import contextlib
import os

import torch
from PIL import Image

from diffusion.errors import UsageError
from diffusion.eval.fid import add_reference_images, list_images, load_fid, read_stats, set_reference_stats, to_uint8

# MLPerf Training SD (v3.1+): FID <= 90 and CLIP score >= 0.15 (mean cosine similarity, ViT-H/14).
MLPERF_FID_MAX = 90.0
MLPERF_CLIP_MIN = 0.15


def batches(n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[tuple[int, int]]:
    """The [start, stop) prompt ranges this rank handles: batch b goes to rank b % world_size."""
    return [(s, min(s + batch_size, n)) for b, s in enumerate(range(0, n, batch_size)) if b % world_size == rank]


class QualityMetrics:
    """FID (torchmetrics, Inception features) and CLIP score (torchmetrics, local CLIP) over generated images.

    ``inception``: the Inception v3 weights file, or any module mapping uint8 NCHW images to (N, d)
    features; ``clip``: a local CLIP directory, or a ready torchmetrics CLIPScore.
    """

    def __init__(self, inception, clip, *, fid_features: int = 2048, device="cpu"):
        from diffusion.eval.clip_score import load_clip_score

        self.device = torch.device(device)
        self.fid = load_fid(inception, fid_features).to(self.device)
        self.clip = (clip if not isinstance(clip, str) else load_clip_score(clip)).to(self.device)
        self.has_reference = False

    def to(self, device) -> "QualityMetrics":
        self.device = torch.device(device)
        self.fid.to(self.device)
        self.clip.to(self.device)
        return self

    def set_reference(
        self,
        *,
        images: str | None = None,
        stats: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 32,
    ) -> None:
        """The real set: a folder of images (each rank reads its share) or an npz with mu and sigma."""
        if (images is None) == (stats is None):
            raise UsageError(
                "give the FID reference as exactly one of --reference_images DIR or --reference_stats FILE.npz"
            )
        if stats is not None:
            set_reference_stats(self.fid, *read_stats(stats), rank=rank)
        else:
            paths = list_images(images)
            add_reference_images(self.fid, paths[rank::world_size], batch_size=batch_size, device=self.device)
        self.has_reference = True

    def update(self, images: list[Image.Image], prompts: list[str]) -> None:
        if not images:
            return
        pixels = to_uint8(images).to(self.device)
        self.fid.update(pixels, real=False)
        self.clip.update(list(pixels), list(prompts))

    def compute(self) -> dict:
        """FID and CLIP score over all ranks (call on every rank), then forget the generated images.

        ``clip_score`` is torchmetrics' (100 x mean cosine, clamped at 0); ``clip_score_cosine`` is the mean
        cosine itself, MLPerf's CLIP score (not clamped: an untrained model can score below 0)."""
        n = int(self.clip.n_samples)
        with self.clip.sync_context():
            total, score_sum = int(self.clip.n_samples), float(self.clip.score)
        if total < 2:
            raise UsageError(f"FID needs at least 2 generated images; got {total} (raise --num_samples)")
        fid = float(self.fid.compute())
        clip = float(self.clip.compute())
        self.fid.reset()
        self.clip.reset()
        return {
            "fid": fid,
            "clip_score": clip,
            "clip_score_cosine": score_sum / total / 100,
            "num_samples": total,
            "num_samples_this_rank": n,
        }


def sample_and_measure(
    pipe,
    prompts: list[str],
    metrics: QualityMetrics,
    *,
    steps: int,
    guidance_scale: float,
    seed: int,
    image_size: int | None,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    autocast_dtype: torch.dtype | None = None,
    save_dir: str | None = None,
    even_calls: bool = False,
    progress: bool = False,
) -> None:
    """Sample this rank's share of ``prompts`` and add the images to ``metrics``. ``even_calls``: every rank
    makes the same number of pipeline calls (a rank short of a batch samples one image and drops it), which
    sharded models need since each forward gathers parameters from all ranks. ``progress``: a bar of this
    rank's images."""
    from diffusion.eval.sampling import sample
    from diffusion.progress import images_bar

    mine = batches(len(prompts), batch_size, rank, world_size)
    if even_calls:
        calls = len(batches(len(prompts), batch_size, 0, world_size))  # rank 0 has the most
        mine += [None] * (calls - len(mine))
    bar = images_bar(sum(stop - start for start, stop in filter(None, mine)), "sampling", progress)
    for span in mine:
        start, stop = span or (0, 1)
        autocast = (
            torch.autocast(pipe.device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            images = sample(
                pipe,
                prompts[start:stop],
                steps=steps,
                guidance_scale=guidance_scale,
                seed=seed,
                image_size=image_size,
                batch_size=batch_size,
                first_index=start,
            )
        if span is None:
            continue
        metrics.update(images, prompts[start:stop])
        bar.update(len(images))
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            for i, im in enumerate(images):
                im.save(os.path.join(save_dir, f"{start + i:05d}.png"))
    bar.close()


def against_mlperf(results: dict) -> dict:
    """MLPerf SD's targets next to the figures (only meaningful with its prompts, Inception and ViT-H/14)."""
    return {
        "fid_max": MLPERF_FID_MAX,
        "clip_score_cosine_min": MLPERF_CLIP_MIN,
        "fid_met": results["fid"] <= MLPERF_FID_MAX,
        "clip_met": results["clip_score_cosine"] >= MLPERF_CLIP_MIN,
    }
