"""FLUX.2 [dev] as a ComposerModel: FLUX.2 [klein]'s step (flux2.py) with the rules of diffusers 0.39's Flux2Pipeline
and its LoRA training script (examples/dreambooth/train_dreambooth_lora_flux2.py).

What differs from klein, top to bottom: each caption is written as Flux2Pipeline's conversation (its system message,
then the caption as the user's message; "[IMG]" removed, as its format_input does) through the processor's chat
template (Mistral's: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]caption[/INST]``, no generation prompt) and
tokenized as the processor tokenizes it (no second ``<s>``), padded to 512 tokens; the text states are the Mistral
language model's hidden states after layers 10, 20 and 30, stacked along the width (3 x 5120 = 15360), the padding
masked (the processor's attention mask: every token but ``<pad>``); the transformer takes the guidance embedding's
input, ``objective.guidance`` (3.5, the script's ``--guidance_scale``; Flux2Pipeline samples at 4.0). The script's
timesteps are klein's: the scheduler's training sigmas, which with dynamic shifting are t uniform in [0, 1] unshifted
(weighting_scheme none), and its LoRA targets klein's (to_q, to_k, to_v, to_out.0, to_qkv_mlp_proj and the
single-stream blocks' attn.to_out). Latents, packing, position ids, the velocity target and validation are klein's.

The text encoder is transformers' Mistral3ForConditionalGeneration, as the pipeline holds it (its Pixtral vision tower
and LM head never run: the states are read from its language model); the pipeline's tokenizer is a PixtralProcessor,
which a pipeline folder's ``tokenizer`` holds (read_tokenizer).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from diffusers.pipelines.flux2.pipeline_flux2 import format_input
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import Mistral3ForConditionalGeneration

from diffusion.batch import INPUT_IDS
from diffusion.models.chat_text import PIPELINE_TEXT_LENGTH, ChatCaptions, ProcessorTokenizer
from diffusion.models.flux2 import Flux2, Flux2Objective
from diffusion.settings import Range, setting

DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers


@dataclass
class Flux2DevObjective(Flux2Objective):
    """A FLUX.2 [dev] run's loss options: klein's, the guidance embedding's input the LoRA script's."""

    guidance: float = setting(
        3.5,
        "the guidance embedding's input in training (train_dreambooth_lora_flux2.py's --guidance_scale; the pipeline "
        "samples at 4.0)",
        Range(ge=0),
    )
    max_sequence_length: int = setting(
        PIPELINE_TEXT_LENGTH,
        "Mistral tokens per caption, the system message and chat template included (Flux2Pipeline's 512; from a "
        "pipeline folder: its tokenizer's model_max_length when at most 8192)",
        Range(gt=0, integer=True),
    )
    pad_token_id: int = setting(
        11,
        "the tokenizer's padding id (Mistral's <pad>), masked in the text encoder as the processor's attention mask "
        "masks it (from a pipeline folder: its tokenizer's)",
        Range(ge=0, integer=True),
    )


class SystemCaptions(ChatCaptions):
    """A tokenizer that writes each caption as Flux2Pipeline does before tokenizing it: the system message and the
    caption as a conversation through the processor's chat template, tokenized by the processor's tokenizer without
    adding special tokens (the template writes ``<s>``; the processor then adds none). Everything else is the
    tokenizer's (``processor.tokenizer``)."""

    def __init__(self, processor):
        super().__init__(processor.tokenizer)
        self.processor = processor

    def __call__(self, text, **kwargs):
        return super().__call__(text, **{"add_special_tokens": False, **kwargs})

    def format(self, text: str) -> str:
        (conversation,) = format_input([text], system_message=SYSTEM_MESSAGE)
        return self.processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)


class Flux2Dev(ProcessorTokenizer, Flux2):
    NAME, DESCRIPTION = "flux2-dev", "a FLUX.2 [dev] model"
    OBJECTIVE = Flux2DevObjective
    PIPELINE = "Flux2Pipeline"
    PARTS = {**Flux2.PARTS, "text_encoder": Mistral3ForConditionalGeneration}
    TEXT_LAYERS = DEV_TEXT_LAYERS
    LORA_TEXT_ENCODERS = ()  # Flux2Pipeline.load_lora_weights reads the transformer's adapters only

    @classmethod
    def caption_tokenizers(cls, tokenizers: dict) -> dict:
        return {key: SystemCaptions(processor) for key, processor in tokenizers.items()}

    @staticmethod
    def denoiser_inputs(configs: dict) -> dict[str, dict[str, int]]:
        """The VAE (its latent channels) and the Mistral3 text encoder (its language model's width, in text_config)."""
        t = configs["transformer"]
        return {
            "vae": {"latent_channels": t.get("in_channels", 128) // 4},
            "text_encoder": {"text_config.hidden_size": t.get("joint_attention_dim", 15360) // len(DEV_TEXT_LAYERS)},
        }

    @property
    def text_body(self):
        """The Mistral language model that gives the text states (the vision tower and LM head never run)."""
        return self.text_encoder.model.language_model

    @staticmethod
    def text_width_source(width: int) -> str:
        return f"{len(DEV_TEXT_LAYERS)} Mistral layers of {width // len(DEV_TEXT_LAYERS)}"

    def pipeline_tokenizer(self, tokenizers: dict):
        """The processor as the pipeline takes it (it formats captions itself), its tokenizer padding to this run's
        caption length."""
        tok = tokenizers[INPUT_IDS]
        processor = tok.processor if isinstance(tok, SystemCaptions) else tok
        if processor.tokenizer.model_max_length != self.text_length:
            processor = copy.deepcopy(processor)
            processor.tokenizer.model_max_length = self.text_length
        return processor
