"""Stable Diffusion 3.5 (family "sd3", sd3.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.flux import CLIP_L, FLUX_VAE, T5_XXL
from diffusion.models.presets.flux import PRESETS as FLUX_PRESETS
from diffusion.models.presets.sd import PRESETS as SD_PRESETS
from diffusion.models.presets.sdxl import OPENCLIP_BIGG
from diffusion.models.presets.sdxl import PRESETS as SDXL_PRESETS

PRESETS: dict[str, dict] = {}

# Stable Diffusion 3.5 (family "sd3", sd3.py): an MMDiT of joint blocks (2x2 patches of 16-channel f8 latents), CLIP-L
# and OpenCLIP-bigG (both with projection: pooled 768 + 1280 = 2048) and T5-XXL (4096: the joint attention's context),
# SD3's VAE (SD's f8 layout, 16 channels, scaling 1.5305, shift 0.0609) and the flow-matching scheduler (shift 3.0).
# Transformer numbers: the published transformer/config.json of stabilityai/stable-diffusion-3.5-medium and
# stabilityai/stable-diffusion-3.5-large; the VAE's: their vae/config.json.
_SD3_VAE = {**FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
_SD3_FLOW_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_SD3_PARTS = {
    "family": "sd3",
    "resolution": 1024,
    "vae": _SD3_VAE,
    "text_encoder": CLIP_L,
    "text_encoder_2": OPENCLIP_BIGG,
    "text_encoder_3": T5_XXL,
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "clip", "max_length": 77},
    "tokenizer_3": {"kind": "t5", "max_length": 256},
    "scheduler": _SD3_FLOW_SCHEDULER,
    "objective": {"max_sequence_length": 256},
}
_SD35_MEDIUM_TRANSFORMER = {  # 2.5B: 24 blocks of 24 x 64 = 1536, the first 13 with a second (image-only) attention
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}
PRESETS["sd35-medium"] = {**_SD3_PARTS, "transformer": _SD35_MEDIUM_TRANSFORMER}
PRESETS["sd35-large"] = {  # 8.1B: 38 blocks of 38 x 64 = 2432, no second attention
    **_SD3_PARTS,
    "transformer": {
        **_SD35_MEDIUM_TRANSFORMER,
        "num_layers": 38,
        "num_attention_heads": 38,
        "caption_projection_dim": 2432,
        "pos_embed_max_size": 192,
        "dual_attention_layers": [],
    },
}
PRESETS["sd3-tiny"] = {
    # SD3.5 Medium's layout (joint blocks, the first with a second attention, QK norm) at a size where a CPU trains a
    # step in a fraction of a second at 64 px: flux-tiny's VAE (4 channels) and T5 (96 wide), sdxl-tiny's two CLIP towers.
    "family": "sd3",
    "resolution": 64,
    "transformer": {
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 96,  # T5's width, to which the CLIPs' 32 + 32 are zero-padded
        "caption_projection_dim": 32,
        "pooled_projection_dim": 64,  # 32 + 32
        "pos_embed_max_size": 16,
        "dual_attention_layers": [0],
        "qk_norm": "rms_norm",
    },
    "vae": FLUX_PRESETS["flux-tiny"]["vae"],
    "text_encoder": SD_PRESETS["sd-tiny"]["text_encoder"],
    "text_encoder_2": SDXL_PRESETS["sdxl-tiny"]["text_encoder_2"],
    "text_encoder_3": {**FLUX_PRESETS["flux-tiny"]["text_encoder_2"], "d_model": 96, "d_ff": 128},
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "clip", "max_length": 77},
    "tokenizer_3": {"kind": "t5", "max_length": 32},
    "scheduler": _SD3_FLOW_SCHEDULER,
    "objective": {"max_sequence_length": 32},
}
