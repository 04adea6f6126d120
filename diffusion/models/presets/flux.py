"""FLUX.1 (family "flux", flux.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.sd import CLIP_IDS
from diffusion.models.presets.sd import PRESETS as SD_PRESETS

PRESETS: dict[str, dict] = {}

# FLUX.1 parts: the 16-channel f8 autoencoder, CLIP-L (pooled) and T5-XXL v1.1 (sequence).
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    **CLIP_IDS,
}
T5_XXL = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "pad_token_id": 0,  # T5's own (the t5 tokenizer kind's too)
    "eos_token_id": 1,
}
# FLUX.1-schnell's transformer: 19 double-stream + 38 single-stream blocks, width 24 x 128 = 3072.
_FLUX_SCHNELL_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
_FLOW_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}

PRESETS["flux-schnell"] = {
    # The MLPerf Training FLUX model (11.9B), trained at 256 px on precomputed T5-XXL + CLIP-L encodings.
    "family": "flux",
    "resolution": 256,
    "transformer": _FLUX_SCHNELL_TRANSFORMER,
    "vae": FLUX_VAE,
    "text_encoder": CLIP_L,
    "text_encoder_2": T5_XXL,
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "t5", "max_length": 256},
    "scheduler": _FLOW_SCHEDULER,
    "objective": {"max_sequence_length": 256},
}
PRESETS["flux-mid"] = {
    # Same width and block design, 4 double + 8 single blocks (~2.5B): trains on one 80 GB GPU, for
    # throughput work where per-block speed is what matters.
    **PRESETS["flux-schnell"],
    "transformer": {**_FLUX_SCHNELL_TRANSFORMER, "num_layers": 4, "num_single_layers": 8},
}
PRESETS["flux-tiny"] = {
    "family": "flux",
    "resolution": 64,
    "transformer": {
        "patch_size": 1,
        "in_channels": 16,  # 4 latent channels x 2x2 packing
        "num_layers": 1,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "guidance_embeds": False,
        "axes_dims_rope": [4, 6, 6],
    },
    "vae": {**SD_PRESETS["sd-tiny"]["vae"], "shift_factor": 0.1, "scaling_factor": 0.5},
    "text_encoder": SD_PRESETS["sd-tiny"]["text_encoder"],
    "text_encoder_2": {
        "vocab_size": 512,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "feed_forward_proj": "gated-gelu",
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "pad_token_id": 0,
        "eos_token_id": 1,
    },
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "t5", "max_length": 32},
    "scheduler": _FLOW_SCHEDULER,
    "objective": {"max_sequence_length": 32},
}

PRESETS["flux-mini"] = {
    # FLUX's block design at width 64 (4 heads x 16), 2 double + 2 single blocks (0.4M), with flux-tiny's VAE and text
    # encoders: the LoRA proof's second FLUX base (docs/lora.md), beside flux-tiny (85k).
    **PRESETS["flux-tiny"],
    "transformer": {**PRESETS["flux-tiny"]["transformer"], "num_layers": 2, "num_attention_heads": 4},
}

PRESETS["flux-small"] = {
    # FLUX's block design at width 512 (8 heads x 64), 2 double + 6 single blocks (44M), with flux-tiny's VAE and
    # text encoders: wide and deep enough on a CPU for per-block work to dominate (token routing's CPU measurement).
    **PRESETS["flux-tiny"],
    "resolution": 256,
    "transformer": {
        **PRESETS["flux-tiny"]["transformer"],
        "num_layers": 2,
        "num_single_layers": 6,
        "attention_head_dim": 64,
        "num_attention_heads": 8,
        "axes_dims_rope": [16, 24, 24],
    },
}
