"""SDXL (family "sdxl", sdxl.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.flux import CLIP_L
from diffusion.models.presets.sd import CLIP_IDS, SD2_SCHEDULER
from diffusion.models.presets.sd import PRESETS as SD_PRESETS

PRESETS: dict[str, dict] = {}

# SDXL-base-1.0 (stabilityai/stable-diffusion-xl-base-1.0): the 2.57B-parameter UNet with "text_time" added
# conditioning (pooled bigG embedding + 6 size/crop time ids of 256 each: 1280 + 6 x 256 = 2816), CLIP-L and
# OpenCLIP-bigG text towers (768 + 1280 = 2048 cross-attention width, penultimate layers), and the SDXL VAE
# (SD's f8 4-channel architecture, rescaled latents: scaling_factor 0.13025).
_SDXL_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "cross_attention_dim": 2048,
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "use_linear_projection": True,
    "norm_num_groups": 32,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
}
OPENCLIP_BIGG = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1280,
    **CLIP_IDS,
}
_SDXL_TOKENIZERS_AND_SCHEDULER = {
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "clip", "max_length": 77},
    "scheduler": {**SD2_SCHEDULER, "timestep_spacing": "leading"},  # SDXL's published schedule
}

PRESETS["sdxl-base"] = {
    "family": "sdxl",
    "resolution": 1024,
    "unet": _SDXL_UNET,
    "vae": {**SD_PRESETS["sd2-base"]["vae"], "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    "text_encoder": CLIP_L,
    "text_encoder_2": OPENCLIP_BIGG,
    **_SDXL_TOKENIZERS_AND_SCHEDULER,
}
PRESETS["sdxl-tiny"] = {
    # The same layout (no attention at the first level, a deeper transformer at the second, two towers) at a
    # size where a CPU trains a step in a fraction of a second at 64 px.
    "family": "sdxl",
    "resolution": 64,
    "unet": {  # sd-tiny's UNet, with SDXL's block layout and added conditioning
        **SD_PRESETS["sd-tiny"]["unet"],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "transformer_layers_per_block": [1, 2],
        "attention_head_dim": [4, 8],
        "cross_attention_dim": 64,  # 32 + 32
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 80,  # 32 + 6 x 8
    },
    "vae": {**SD_PRESETS["sd-tiny"]["vae"], "scaling_factor": 0.13025},
    "text_encoder": SD_PRESETS["sd-tiny"]["text_encoder"],
    "text_encoder_2": {**SD_PRESETS["sd-tiny"]["text_encoder"], "hidden_act": "gelu", "num_attention_heads": 2},
    **_SDXL_TOKENIZERS_AND_SCHEDULER,
}
