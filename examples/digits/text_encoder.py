"""A tiny CLIP text encoder, pretrained contrastively on an image-caption folder, for train.py's text_encoder=DIR.

Real SD and FLUX runs condition on a pretrained, frozen CLIP text encoder loaded from a local path. The
tiny presets' text encoders are random, and a random frozen encoder maps captions that differ in one word
("a handwritten digit seven" / "... eight") to nearly the same states: the shared prefix dominates them,
and a denoiser needs thousands of steps to find the difference (measured in docs/digits.md). This does
for the digits what OpenAI did for CLIP at scale: train a text tower and an image tower so that matching
pairs score highest (the symmetric InfoNCE loss; captions repeated in a batch count as matches), then
keep the text tower, saved as a ``CLIPTextModel`` with the preset's own config and tokenizer (and, with
``--projected``, as a ``CLIPTextModelWithProjection`` with its trained projection: SD3's CLIP slots).

    python examples/digits/text_encoder.py FOLDER OUT [--preset sd-tiny] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def read_folder(folder: str, size: int) -> tuple[torch.Tensor, list[str]]:
    """Images (N, 3, size, size) in [-1, 1] and their captions, from IMAGE.png + IMAGE.txt pairs."""
    names = sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".png"))
    if not names:
        raise SystemExit(f"text_encoder: no .png images in {folder}")
    images, captions = [], []
    for name in names:
        image = Image.open(os.path.join(folder, name + ".png")).convert("RGB").resize((size, size), Image.BICUBIC)
        images.append(np.asarray(image))
        with open(os.path.join(folder, name + ".txt")) as f:
            captions.append(f.read().strip())
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return pixels, captions


def pretrain(
    folder: str,
    out: str,
    *,
    preset: str = "sd-tiny",
    steps: int = 300,
    batch_size: int = 64,
    image_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    vision_out: str | None = None,
    projected_out: str | None = None,
) -> float:
    """Train, save the text tower to OUT (and with ``vision_out`` the image tower there, as a CLIPVisionModel
    with its normalisation: the stand-in for DINOv2 in REPA, repa_encoder=DIR; with ``projected_out`` the text tower
    and its trained projection there, as a CLIPTextModelWithProjection); returns the last batch's
    image->caption retrieval accuracy."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextModel, CLIPTextModelWithProjection, CLIPVisionModel

    from diffusion.models.presets import get_preset
    from diffusion.models.tokenizer import build_tokenizer

    spec = get_preset(preset)
    torch.manual_seed(seed)
    text = spec["text_encoder"]
    vision = dict(
        image_size=image_size,
        patch_size=4,
        num_channels=3,
        hidden_size=text["hidden_size"],
        intermediate_size=2 * text["hidden_size"],
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=text["hidden_size"]))
    pixels, captions = read_folder(folder, image_size)
    tokenizer = build_tokenizer(spec["tokenizer"])
    ids = tokenizer(
        captions, padding="max_length", max_length=text["max_position_embeddings"], truncation=True, return_tensors="pt"
    ).input_ids
    caption_of = {c: i for i, c in enumerate(dict.fromkeys(captions))}
    label = torch.tensor([caption_of[c] for c in captions])
    opt = torch.optim.AdamW(clip.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(captions), (batch_size,), generator=generator)
        logits = clip(input_ids=ids[batch], pixel_values=pixels[batch]).logits_per_image
        match = (label[batch, None] == label[None, batch]).float()  # same caption: a positive pair
        loss = (
            F.cross_entropy(logits, match / match.sum(1, keepdim=True))
            + F.cross_entropy(logits.T, match / match.sum(0, keepdim=True).T)
        ) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    accuracy = float(match[torch.arange(batch_size), logits.argmax(1)].mean())
    encoder = CLIPTextModel(clip.config.text_config)
    encoder.text_model.load_state_dict(clip.text_model.state_dict())
    encoder.save_pretrained(out)
    if projected_out:  # the pooled vector projected as the contrastive loss trained it
        projected = CLIPTextModelWithProjection(clip.config.text_config)
        projected.text_model.load_state_dict(clip.text_model.state_dict())
        projected.text_projection.load_state_dict(clip.text_projection.state_dict())
        projected.save_pretrained(projected_out)
    if vision_out:
        tower = CLIPVisionModel(clip.config.vision_config)
        tower.vision_model.load_state_dict(clip.vision_model.state_dict())
        tower.save_pretrained(vision_out)
        with open(os.path.join(vision_out, "preprocessor_config.json"), "w") as f:  # it saw pixels in [-1, 1]
            json.dump({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "size": image_size}, f)
    return accuracy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="images (.png) with sidecar captions (.txt)")
    p.add_argument("out", help="where to save the CLIPTextModel")
    p.add_argument("--preset", default="sd-tiny", help="whose text_encoder config and tokenizer to use")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--vision", help="also keep the image tower here (a CLIPVisionModel, for REPA's repa_encoder=DIR)")
    p.add_argument("--projected", help="also keep the text tower with its trained projection here (SD3's CLIP slots)")
    args = p.parse_args(argv)
    start = time.time()
    accuracy = pretrain(
        args.folder,
        args.out,
        preset=args.preset,
        steps=args.steps,
        image_size=args.image_size,
        vision_out=args.vision,
        projected_out=args.projected,
    )
    print(
        f"text_encoder: {args.steps} steps in {time.time() - start:.1f} s; image->caption accuracy on the last "
        f"batch {accuracy:.1%}; saved to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
