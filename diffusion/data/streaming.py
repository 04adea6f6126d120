"""MDS (MosaicML Streaming) datasets for training.

Image-caption shards: an image column (``image`` or ``jpg``; raw bytes or a PIL-decoded MDS encoding)
and a caption column (``caption`` or ``txt``); the caption is tokenized once per tokenizer the model
has (CLIP ids for SD; CLIP and T5 ids for FLUX). Precomputed shards: ``latent_moments`` (2C,h,w VAE
posterior mean and log-variance) or ``latents`` (C,h,w), plus ``text_embeds`` (L,D) and, for FLUX,
``pooled_text_embeds`` (D'); validation shards may carry ``timestep_index`` (MLPerf FLUX).
"""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from streaming import StreamingDataset
from torchvision import transforms

from diffusion.models.base import IMAGE, LATENT_MOMENTS, LATENTS, TEXT_EMBEDS
from diffusion.data.synthetic import SAMPLE_ID
from diffusion.models.flux import POOLED_TEXT_EMBEDS, TIMESTEP_INDEX

IMAGE_COLUMNS = ("image", "jpg", "png", "webp")
CAPTION_COLUMNS = ("caption", "txt")


def image_transform(image_size: int) -> transforms.Compose:
    """Resize the shorter side, center crop, scale to [-1, 1]."""
    return transforms.Compose([
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])


def _first(sample: dict, names: tuple[str, ...], what: str, index: int):
    for name in names:
        if name in sample:
            return sample[name]
    raise KeyError(f"sample {index} has no {what} column (looked for {', '.join(names)}; it has "
                   f"{', '.join(sorted(sample))})")


class StreamingImageCaptionDataset(StreamingDataset):
    def __init__(self, *, tokenizers: dict, image_size: int, **streaming_kwargs):
        super().__init__(**streaming_kwargs)
        self.tokenizers = tokenizers
        self.transform = image_transform(image_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(index)
        image = _first(sample, IMAGE_COLUMNS, "image", index)
        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
        image = image.convert("RGB")
        caption = _first(sample, CAPTION_COLUMNS, "caption", index)
        out = {IMAGE: self.transform(image)}
        for key, tok in self.tokenizers.items():
            out[key] = tok(caption, padding="max_length", truncation=True, max_length=tok.model_max_length,
                           return_tensors="pt").input_ids[0]
        return out


class StreamingLatentsDataset(StreamingDataset):
    def __init__(self, *, with_index: bool = False, **streaming_kwargs):
        super().__init__(**streaming_kwargs)
        self.with_index = with_index  # add "sample_id" (validation: fixed noise per sample)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(index)
        out = {}
        for key in (LATENT_MOMENTS, LATENTS, TEXT_EMBEDS, POOLED_TEXT_EMBEDS):
            if key in sample:
                out[key] = torch.from_numpy(np.asarray(sample[key], dtype=np.float32))
        if TIMESTEP_INDEX in sample:
            out[TIMESTEP_INDEX] = torch.tensor(int(sample[TIMESTEP_INDEX]))
        if self.with_index:
            out[SAMPLE_ID] = torch.tensor(index)
        if TEXT_EMBEDS not in out or not ({LATENT_MOMENTS, LATENTS} & out.keys()):
            raise KeyError(f"sample {index} is not a precomputed sample: it needs '{TEXT_EMBEDS}' and "
                           f"'{LATENT_MOMENTS}' or '{LATENTS}', it has {', '.join(sorted(sample))}")
        return out
