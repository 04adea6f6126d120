"""Stable Diffusion 2 (family "sd", sd.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

# Stable Diffusion 2 noise schedule (scaled-linear betas, 1000 steps).
SD2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "prediction_type": "epsilon",
    "steps_offset": 1,
}

# The clip tokenizer's ids (tokenizer.py): CLIPTextModel pools at the eos token, so every CLIP text config names them
CLIP_IDS = {"bos_token_id": 486, "eos_token_id": 487, "pad_token_id": 487}

PRESETS: dict[str, dict] = {
    # The 865M-parameter SD2-base UNet, an OpenCLIP-ViT-H-sized text tower (1024 wide, 23 layers: SD2
    # conditions on the penultimate layer of the 24) and the f8, 4-channel KL autoencoder.
    "sd2-base": {
        "family": "sd",
        "resolution": 512,
        "unet": {
            "sample_size": 64,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": [320, 640, 1280, 1280],
            "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
            "attention_head_dim": [5, 10, 20, 20],
            "cross_attention_dim": 1024,
            "use_linear_projection": True,
            "norm_num_groups": 32,
            "flip_sin_to_cos": True,
            "freq_shift": 0,
        },
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "norm_num_groups": 32,
            "sample_size": 512,
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "vocab_size": 49408,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 23,
            "num_attention_heads": 16,
            "max_position_embeddings": 77,
            "hidden_act": "gelu",
            "projection_dim": 512,
            **CLIP_IDS,
        },
        "tokenizer": {"kind": "clip", "max_length": 77},
        "scheduler": SD2_SCHEDULER,
    },
    # Same layout at a size where a CPU runs a training step in well under a second at 64 px.
    "sd-tiny": {
        "family": "sd",
        "resolution": 64,
        "unet": {
            "sample_size": 8,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 1,
            "block_out_channels": [32, 64],
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "attention_head_dim": 8,
            "cross_attention_dim": 32,
            "use_linear_projection": True,
            "norm_num_groups": 8,
        },
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "layers_per_block": 1,
            "block_out_channels": [8, 16, 16, 16],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "norm_num_groups": 8,
            "sample_size": 64,
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "vocab_size": 512,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 77,
            "hidden_act": "gelu",
            "projection_dim": 32,
            **CLIP_IDS,
        },
        "tokenizer": {"kind": "clip", "max_length": 77},
        "scheduler": SD2_SCHEDULER,
    },
}
