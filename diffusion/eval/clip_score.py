"""CLIP score with torchmetrics' CLIPScore on a CLIP model from a local Hugging Face directory.

torchmetrics loads from a string only for hub names it knows (``openai/...``); a local snapshot is given
as its other form, a callable returning (model, processor). The processor here is a tokenizer and a
CLIPImageProcessor read from the same directory; captions longer than the text tower's context are cut
to fit, keeping the end token, as open_clip's tokenizer (MLPerf's) does.

torchmetrics reports 100 x the mean cosine similarity of image and caption embeddings (clamped at 0);
MLPerf's CLIP score (target >= 0.15) is the mean cosine itself, i.e. torchmetrics' value / 100.
"""

from __future__ import annotations

import os

from diffusion.errors import UsageError

CLIP_HINT = (
    "a local CLIP snapshot in Hugging Face layout (config.json, weights, tokenizer and "
    "preprocessor_config.json), e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K as MLPerf uses; "
    "see docs/evaluation.md"
)


class LocalCLIPProcessor:
    """CLIPProcessor's call shape (``text=`` or ``images=``) over a tokenizer and an image processor."""

    def __init__(self, tokenizer, image_processor, max_length: int):
        self.tokenizer, self.image_processor, self.max_length = tokenizer, image_processor, max_length

    def __call__(self, text=None, images=None, return_tensors="pt", padding=True, **_):
        if text is not None:
            return self.tokenizer(
                text, padding=padding, truncation=True, max_length=self.max_length, return_tensors=return_tensors
            )
        return self.image_processor(images=images, return_tensors=return_tensors)


def load_clip(path: str):
    """(CLIPModel, processor) from a local directory or a hub id in the local cache, nothing downloaded."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    from diffusion.file_checks import check_weights
    from diffusion.models.hub_cache import hub_id_to_path

    path = hub_id_to_path(path, "--clip")
    if not os.path.isdir(path):
        raise UsageError(f"--clip: {path!r} is not a directory; pass {CLIP_HINT}")
    check_weights(path, "--clip")
    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = CLIPImageProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"--clip: cannot load a CLIP model from {path!r} ({str(e).splitlines()[0][:200]}); pass {CLIP_HINT}"
        ) from None
    max_length = min(model.config.text_config.max_position_embeddings, tokenizer.model_max_length)
    return _features_as_tensors(model), LocalCLIPProcessor(tokenizer, image_processor, max_length)


def _features_as_tensors(model):
    """The one shim between the two tested stacks here: transformers 5's get_image_features/get_text_features
    return a BaseModelOutputWithPooling (the projected embedding in ``pooler_output``), transformers 4's the
    tensor, and torchmetrics (<= 1.9) calls ``.norm`` on what it gets. This instance returns the tensor on both."""
    import torch

    def as_tensor(method):
        def features(*args, **kwargs):
            out = method(*args, **kwargs)
            return out if isinstance(out, torch.Tensor) else out.pooler_output

        return features

    for name in ("get_image_features", "get_text_features"):
        setattr(model, name, as_tensor(getattr(model, name)))
    return model


def load_clip_score(path: str):
    from torchmetrics.multimodal.clip_score import CLIPScore

    model, processor = load_clip(path)
    return CLIPScore(model_name_or_path=lambda: (model, processor))
