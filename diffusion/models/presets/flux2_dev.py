"""FLUX.2 [dev] (family "flux2-dev", flux2_dev.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.flux2 import FLUX2_SCHEDULER, FLUX2_TRANSFORMER, FLUX2_VAE
from diffusion.models.presets.flux2 import PRESETS as FLUX2_PRESETS

PRESETS: dict[str, dict] = {}

# FLUX.2 [dev] (family "flux2-dev", flux2_dev.py; Flux2Pipeline). The transformer's numbers are those of
# black-forest-labs/FLUX.2-dev transformer/config.json (as diffusers' scripts/convert_flux2_to_diffusers.py writes them
# for flux2-dev): 8 double + 48 single blocks of 48 heads x 128 = 6144, 128 input channels, the text width three Mistral
# layers' (3 x 5120 = 15360), a guidance embedding (the class default guidance_embeds=True). The text encoder is
# Mistral Small 3.1/3.2 24B (Mistral3ForConditionalGeneration: mistralai/Mistral-Small-3.2-24B-Instruct-2506's
# config.json, which the conversion script reads; transformers' Mistral3Config defaults are Mistral Small 3.1's, the
# same numbers): a 40-layer Mistral 5120 wide (32 heads, 8 KV heads of 128) and a 24-layer Pixtral vision tower. The
# VAE is klein's (AutoencoderKLFlux2 at its class defaults), the sampling schedule klein's (FLUX.1-dev's scheduler with
# dynamic shifting, which the conversion script copies).
_MISTRAL_SMALL_31 = {
    "text_config": {
        "model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0, "sliding_window": None,
        "hidden_act": "silu", "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540, "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
    "image_token_index": 10,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "multimodal_projector_bias": False,
    "tie_word_embeddings": False,
}  # fmt: skip
PRESETS["flux2-dev"] = {
    # 32.2B transformer, Mistral Small 3.1 24B text encoder; 1024 px, 512 caption tokens (the pipeline's defaults),
    # guidance 3.5 in training (train_dreambooth_lora_flux2.py's --guidance_scale)
    "family": "flux2-dev",
    "resolution": 1024,
    "transformer": {
        **FLUX2_TRANSFORMER, "num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48,
        "joint_attention_dim": 15360, "guidance_embeds": True,
    },
    "vae": FLUX2_VAE,
    "text_encoder": _MISTRAL_SMALL_31,
    "tokenizer": {"kind": "mistral", "max_length": 512},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 266},  # the mistral kind pads with <pad>, 266
}  # fmt: skip
PRESETS["flux2-dev-tiny"] = {
    # dev's layout at CPU size: flux2-tiny's transformer with a guidance embedding, a 30-layer Mistral 32 wide (layers
    # 10, 20 and 30 are the pipeline's, so an exported folder samples with its defaults) beside a 1-layer Pixtral
    # tower (unused), flux2-tiny's VAE; 96 caption tokens (the system message's 49 and the caption)
    **FLUX2_PRESETS["flux2-tiny"],
    "family": "flux2-dev",
    "transformer": {**FLUX2_PRESETS["flux2-tiny"]["transformer"], "guidance_embeds": True},
    "text_encoder": {
        **_MISTRAL_SMALL_31,
        "text_config": {
            **_MISTRAL_SMALL_31["text_config"], "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 256, "bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 266,
        },
        "vision_config": {
            **_MISTRAL_SMALL_31["vision_config"], "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "head_dim": 8, "patch_size": 8, "image_size": 64,
        },
        "image_token_index": 263,  # the mistral kind's [IMG]
    },
    "tokenizer": {"kind": "mistral", "max_length": 96},
    "objective": {"max_sequence_length": 96, "pad_token_id": 266},
}  # fmt: skip
