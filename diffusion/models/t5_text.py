"""The T5 caption length that FLUX.1 and SD3 share: how many T5 tokens a caption takes, and the length a pipeline
folder's T5 tokenizer records."""

from __future__ import annotations

from diffusion.batch import T5_INPUT_IDS

T5_LENGTH = 256  # T5 tokens per caption when a folder names none (FluxPipeline's and StableDiffusion3Pipeline's 512 is
# the most the pipelines take; diffusers' LoRA scripts train at 77-512)


def t5_length(tokenizer) -> int:
    """T5 tokens per caption for a pipeline whose T5 tokenizer is ``tokenizer``: its model_max_length (what the
    folder's model was trained with, exported beside it, and what sampling pads to), or T5_LENGTH when it names none
    (transformers' sentinel for "no limit" is 1e30)."""
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and 0 < length <= 1_000_000:
        return length
    return T5_LENGTH


def t5_objective(tokenizers: dict) -> dict:
    """A folder's captions take as many T5 tokens as its T5 tokenizer pads to (t5_length): a model trained at 32 and
    fine-tuned at 256 would attend to 224 pad states it never saw, and sample at yet another length."""
    return {"max_sequence_length": t5_length(tokenizers[T5_INPUT_IDS])} if T5_INPUT_IDS in tokenizers else {}
