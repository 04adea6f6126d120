"""The chat-template text path that FLUX.2, Z-Image and Qwen-Image share: each caption formatted as a chat message by
the tokenizer's template before it is tokenized (``ChatCaptions``), the caption length a pipeline folder's tokenizer
records (``qwen_length``), padding masked by the objective's ``pad_token_id``, and a language model's hidden states
as the text states, one row per token.

A family composes it by listing ``ChatTemplateText`` before ``LatentDiffusion`` among its bases, and gives it
``text_states(ids, mask)`` (which layers it takes, how they are stacked) and ``text_body`` (the module whose states
those are); its objective section declares ``max_sequence_length`` and ``pad_token_id``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from diffusion.batch import IMAGE, INPUT_IDS, LATENT_MOMENTS, TEXT_EMBEDS
from diffusion.models.base import checked_text_states, checked_token_ids, hw
from diffusion.models.flops import count_flops, encode_flops
from diffusion.models.tokenizer import padded_to
from diffusion.settings import Range, setting

PIPELINE_TEXT_LENGTH = 512  # Flux2KleinPipeline's and ZImagePipeline's max_sequence_length
MAX_FOLDER_LENGTH = 8192  # a folder tokenizer's model_max_length above this is the language model's, not ours


@dataclass
class ChatText:
    """The settings the chat-template text path reads, for a family's objective section to take (settings.same_as)."""

    max_sequence_length: int = setting(
        PIPELINE_TEXT_LENGTH,
        "Qwen3 tokens per caption, chat template included (from a pipeline folder: its tokenizer's model_max_length "
        f"when at most {MAX_FOLDER_LENGTH}, else the pipeline's {PIPELINE_TEXT_LENGTH})",
        Range(gt=0, integer=True),
    )
    pad_token_id: int = setting(
        151643,
        "the tokenizer's padding id (Qwen's end-of-text token), masked in the text encoder as the pipeline masks it "
        "(from a pipeline folder: its tokenizer's)",
        Range(ge=0, integer=True),
    )


def qwen_length(tokenizer) -> int:
    """Tokens per caption for a pipeline whose tokenizer is ``tokenizer``: its model_max_length when an export set it
    (at most MAX_FOLDER_LENGTH), else the pipeline's 512 (a published folder records the language model's context)."""
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and 0 < length <= MAX_FOLDER_LENGTH:
        return length
    return PIPELINE_TEXT_LENGTH


class ChatCaptions:
    """A tokenizer that formats each caption as Flux2KleinPipeline does before tokenizing it: one user message
    through the tokenizer's chat template, generation prompt added, thinking off (``thinking``: on, as ZImagePipeline
    formats it). Everything else is the tokenizer's (``tokenizer``)."""

    thinking = False  # (a checkpoint pickled before the attribute existed formats as it did)

    def __init__(self, tokenizer, thinking: bool = False):
        self.tokenizer = tokenizer
        self.thinking = thinking

    def __call__(self, text, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        formatted = [self.format(t) for t in texts]
        return self.tokenizer(formatted[0] if isinstance(text, str) else formatted, **kwargs)

    def format(self, text: str) -> str:
        """The caption as the pipeline hands it to the tokenizer."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.thinking,
        )

    def __getattr__(self, name):
        if name == "tokenizer":  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


class ChatTemplateText:
    """A family's text side when its captions go through a chat template into a language model (see the module's
    docstring for what the family provides)."""

    THINKING = False  # the chat template's enable_thinking, as the pipeline formats a caption

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """A folder's caption length and padding id, from its tokenizer (qwen_length)."""
        tok = tokenizers.get(INPUT_IDS)
        if tok is None:
            return {}
        return {"max_sequence_length": qwen_length(tok), "pad_token_id": tok.pad_token_id}

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: ChatCaptions(tok, cls.THINKING) for key, tok in tokenizers.items()}

    @property
    def text_width(self) -> int:
        """The width of the text states the transformer takes."""
        return self.transformer.config.joint_attention_dim

    @property
    def token_length(self) -> int:
        """Token ids per caption (a family whose pipeline drops some of their states has more ids than states)."""
        return self.text_length

    def batch_shapes(self, image_size: int | tuple[int, int], precomputed: bool) -> dict[str, tuple]:
        height, width = hw(image_size)
        if precomputed:
            h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
            return {
                LATENT_MOMENTS: ((2 * self.latent_channels, h, w), torch.float32, None),
                TEXT_EMBEDS: ((self.text_length, self.text_width), torch.float32, None),
            }
        return {
            IMAGE: ((3, height, width), torch.float32, None),
            INPUT_IDS: ((self.token_length,), torch.long, self.text_encoder.config.get_text_config().vocab_size),
        }

    def checked_ids(self, batch: dict) -> torch.Tensor:
        """The batch's token ids, refused when longer than a caption's (template tokens included)."""
        return checked_token_ids(batch[INPUT_IDS], INPUT_IDS, self.text_length, self.token_length)

    def encode_text(self, batch: dict) -> tuple[torch.Tensor, None]:
        """(the text states (B, L, D) (text_states), None: no pooled embedding), checked against the transformer's
        width."""
        with torch.no_grad():
            if TEXT_EMBEDS in batch:
                seq = batch[TEXT_EMBEDS]
            else:
                ids = self.checked_ids(batch)
                seq = self.text_states(ids, (ids != self.objective["pad_token_id"]).long())
        width = self.text_width
        checked_text_states(
            seq, self.text_length, f"joint_attention_dim={width} ({self.text_width_source(width)})", width
        )
        return seq, None

    def text_features(self, batch: dict) -> dict[str, torch.Tensor]:
        return {TEXT_EMBEDS: self.encode_text(batch)[0]}

    def pipeline_tokenizer(self, tokenizers: dict):
        """The tokenizer as the pipeline takes it: unwrapped (the pipeline formats captions itself), padding to this
        run's caption length (the pipeline, and an exported folder, pad as this run trains)."""
        tok = tokenizers[INPUT_IDS]
        return padded_to(tok.tokenizer if isinstance(tok, ChatCaptions) else tok, self.text_length)

    def _encoder_flops(self, image_size: int | tuple[int, int]) -> float:
        """The VAE's encoder and the text body over a caption."""
        return encode_flops(self.vae, (3, *hw(image_size))) + self.text_body_flops()

    def text_body_flops(self) -> float:
        """The text body over one caption's token ids (all its layers run; an LM head does not)."""
        return count_flops(
            type(self.text_body),
            self.text_body.config,
            train=False,
            prepare=rope_on_meta,
            args=lambda: (torch.zeros(1, self.token_length, dtype=torch.long),),
        )


class ProcessorTokenizer:
    """A chat-template family whose pipeline's tokenizer is a transformers processor (FLUX.2 [dev]'s PixtralProcessor,
    Qwen-Image 2.1's Qwen3VLProcessor): its folder read as one, the caption length and padding id its tokenizer's.
    Listed before the family's ChatTemplateText among its bases."""

    @classmethod
    def read_tokenizer(cls, folder: str):
        """The pipeline's tokenizer folder: a processor (its tokenizer, image processor, chat template)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(folder, local_files_only=True)

    @classmethod
    def folder_objective(cls, tokenizers: dict) -> dict:
        """The chat template's (the caption length and padding id of the folder's tokenizer), read from the
        processor's."""
        processor = tokenizers.get(INPUT_IDS)
        return super().folder_objective({} if processor is None else {INPUT_IDS: processor.tokenizer})


def rope_on_meta(body: torch.nn.Module) -> None:
    """Qwen3's (and Qwen2.5-VL's) rotary embedding in transformers 4.57 turns autocast off for its device type, which
    the meta device has not (transformers 5 no longer does): it runs with that switch a no-op (its angles, a
    (D/2 x 1) by (1 x L) product, are counted; no FLOPs worth counting)."""
    original = body.rotary_emb.forward

    def angles(x, position_ids):
        autocast = torch.autocast
        torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
        try:
            return original(x, position_ids)
        finally:
            torch.autocast = autocast

    body.rotary_emb.forward = angles
