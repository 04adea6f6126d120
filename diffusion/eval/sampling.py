"""Sampling: prompts -> PNG files and a grid, with diffusers pipelines.

A source is a training checkpoint (rebuilt with its EMA weights) or an exported diffusers pipeline
directory. How each family's pipeline is called is the family's (``Family.sampling_options``, ``SAMPLERS``): SD
samples with DDIM or Euler; FLUX and the other transformers with flow-matching Euler. Guidance is classifier-free
(for FLUX: diffusers' true CFG against the empty prompt, meaningful for models trained with text dropout).
Each image has its own CPU-seeded generator (seed + image index), so a prompt file gives the same images
whatever the batch size or device.
"""

from __future__ import annotations

import csv
import inspect
import math
import os
import re

import torch
from PIL import Image

from diffusion.errors import UsageError
from diffusion.models.base import hw
from diffusion.models.build import pipeline_family


def read_prompts(path: str) -> list[str]:
    """One prompt per line, or a tsv with a 'caption' column (the MLPerf COCO-2014 30k layout)."""
    if not os.path.isfile(path):
        raise UsageError(f"--prompts: file {path!r} does not exist")
    with open(path, newline="") as f:
        if path.endswith(".tsv"):
            rows = list(csv.DictReader(f, delimiter="\t"))
            if rows and "caption" not in rows[0]:
                raise UsageError(f"--prompts: {path!r} has no 'caption' column (columns: {', '.join(rows[0])})")
            prompts = [r["caption"] for r in rows]
        else:
            prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts: {path!r} holds no prompts")
    return prompts


def load_pipeline(
    source: str,
    *,
    use_ema: bool = True,
    sampler: str | None = None,
    device: str = "cpu",
    trust: bool = False,
    trust_flag: str = "trust_checkpoint=true",
    lora: str | None = None,
    lora_scale: float = 1.0,
):
    """An exported pipeline directory (its JSON and weight files checked first), or a checkpoint rebuilt
    with its EMA weights; ``trust``: unpickle a checkpoint unrestricted (unpickling.py). ``lora``: a folder of
    LoRA adapters loaded into a pipeline directory's denoiser (checked against the base they record), acting at
    ``lora_scale``; a LoRA run's checkpoint carries its own adapters, which act at ``lora_scale`` too."""
    import diffusers

    from diffusion.file_checks import check_weights, read_json
    from diffusion.models.build import family_of_dir, pipeline_index
    from diffusion.models.hub_cache import hub_id_to_path

    source = hub_id_to_path(source, "source")
    index = pipeline_index(source)
    if index is not None:
        for part in read_json(index, "source"):
            if os.path.isdir(os.path.join(source, part)):
                check_weights(os.path.join(source, part), "source")
        load = loader(lora) if lora is not None else None  # the folder checked before the pipeline loads, not after
        pipe = family_of_dir(source).open_pipeline(source)
        if load is not None:
            load(pipe, source, lora_scale)
    else:
        from diffusion.eval.trained_model import load_trained
        from diffusion.techniques import active

        if lora is not None:
            raise UsageError(
                f"--lora {lora} takes the base pipeline folder the adapters were trained on as the source, not a "
                f"training checkpoint ({source}); a LoRA run's checkpoint samples with its own adapters"
            )
        built, config, _ = load_trained(source, use_ema=use_ema, trust=trust, trust_flag=trust_flag)
        for technique in active(config):
            technique.scale_for_sampling(built.model, lora_scale)
        pipe = built.model.pipeline(built.tokenizers)
    family = pipeline_family(pipe)
    if sampler is not None and not family.SAMPLERS and sampler != "euler":
        raise UsageError(
            f"--sampler {sampler}: {family.DESCRIPTION} samples with flow-matching Euler only (--sampler euler)"
        )
    if sampler is not None and family.SAMPLERS:  # a scheduler of the family's choices, from the pipeline's config
        if sampler not in family.SAMPLERS:
            raise UsageError(f"--sampler {sampler!r} is not one of {', '.join(family.SAMPLERS)}")
        pipe.scheduler = getattr(diffusers, family.SAMPLERS[sampler]).from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def loader(folder: str):
    """--lora ``folder``: the exporting technique's loader of it into a pipeline (the folder checked first)."""
    from diffusion.techniques import exporting

    return exporting("--lora").pipeline_loader(folder)


@torch.no_grad()
def sample(
    pipe,
    prompts: list[str],
    *,
    steps: int = 30,
    guidance_scale: float = 1.0,
    seed: int = 0,
    image_size: int | tuple[int, int] | None = None,
    batch_size: int = 4,
    first_index: int = 0,
) -> list[Image.Image]:
    """Images of ``prompts``: square (``image_size``, default the VAE's configured size) or (height, width)."""
    family = pipeline_family(pipe)
    height, width = hw(image_size or native_size(pipe))
    if family.SIDES_OF_8 and (height % 8 or width % 8):  # whatever the model's own size factor
        raise UsageError(
            f"{width}x{height} (w x h): diffusers' {family.PIPELINE} samples only sides that are multiples of 8; "
            "ask for such a size (train at a resolution whose buckets have them)"
        )
    images = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        gens = [torch.Generator().manual_seed(seed + first_index + start + i) for i in range(len(chunk))]
        kwargs = dict(prompt=chunk, num_inference_steps=steps, height=height, width=width, generator=gens)
        kwargs |= family.sampling_options(pipe, guidance_scale, len(chunk))
        images.extend(family.sample_images(pipe, kwargs))
    return images


def native_size(pipe) -> int:
    """The side a pipeline samples by default: its VAE's configured size, else the pipeline's own default
    (QwenImagePipeline's VAE records none: 1024 px), else its call's output_resolution (QwenImage21Pipeline has no
    default_sample_size: 1024 px)."""
    size = getattr(pipe.vae.config, "sample_size", None)
    default = getattr(pipe, "default_sample_size", None)
    if size or default:
        return size or default * pipe.vae_scale_factor
    return inspect.signature(pipe.__call__).parameters["output_resolution"].default  # QwenImage21Pipeline's 1024


def grid(images: list[Image.Image]) -> Image.Image:
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    out = Image.new("RGB", (cols * w, rows * h), "white")
    for i, im in enumerate(images):
        out.paste(im, ((i % cols) * w, (i // cols) * h))
    return out


def save(images: list[Image.Image], prompts: list[str], out_dir: str, captions: bool = False) -> list[str]:
    """NNNNN-prompt.png per image and grid.png; ``captions``: each prompt beside its image as NNNNN-prompt.txt
    and no grid, a folder data.py convert reads as a dataset (a prior dataset of the base's own samples)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, (im, prompt) in enumerate(zip(images, prompts)):
        slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:48] or "prompt"
        paths.append(os.path.join(out_dir, f"{i:05d}-{slug}.png"))
        im.save(paths[-1])
        if captions:
            with open(paths[-1][: -len(".png")] + ".txt", "w") as f:
                f.write(prompt)
    if not captions:
        grid(images).save(os.path.join(out_dir, "grid.png"))
    return paths
