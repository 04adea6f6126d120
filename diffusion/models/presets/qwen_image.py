"""Qwen-Image (family "qwen-image", qwen_image.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

PRESETS: dict[str, dict] = {}

# Qwen-Image (family "qwen-image", qwen_image.py; QwenImagePipeline). The transformer's numbers are those of
# Qwen/Qwen-Image transformer/config.json: 60 dual-stream blocks of 24 heads x 128 = 3072, 64 input channels (16 latent
# channels x 2x2), the text width Qwen2.5-VL-7B's 3584, RoPE axes (16, 56, 56), no guidance embedding. The VAE is
# AutoencoderKLQwenImage at its class defaults (vae/config.json: base_dim 96, z_dim 16, dim_mult 1, 2, 4, 4, f8, the
# latents_mean/std of the class); the text encoder Qwen2.5-VL-7B-Instruct (Qwen/Qwen-Image text_encoder/config.json);
# the sampling schedule scheduler/scheduler_config.json's (dynamic shift between 256 and 8192 image tokens).
_QWEN_IMAGE_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
QWEN_IMAGE_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}
_QWEN25_VL_7B = {
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": 32768, "use_sliding_window": False,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu",
    },
    "tie_word_embeddings": False,
}  # fmt: skip
QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
PRESETS["qwen-image"] = {
    # 20.4B transformer, Qwen2.5-VL-7B text encoder (8.3B with its vision tower); 1024 px, 512 caption states (the
    # pipeline's defaults)
    "family": "qwen-image",
    "resolution": 1024,
    "transformer": _QWEN_IMAGE_TRANSFORMER,
    "vae": QWEN_IMAGE_VAE,
    "text_encoder": _QWEN25_VL_7B,
    "tokenizer": {"kind": "qwen-image", "max_length": 512},
    "scheduler": QWEN_IMAGE_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the offline tokenizer pads with 256
}
PRESETS["qwen-image-tiny"] = {
    # Qwen-Image's layout at CPU size: 2 dual-stream blocks of width 32, a 2-layer Qwen2.5-VL 32 wide (a 1-block vision
    # tower beside it, unused), the VAE with 4 channels (f8, 64 px -> 4 x 4 tokens)
    "family": "qwen-image",
    "resolution": 64,
    "transformer": {
        **_QWEN_IMAGE_TRANSFORMER, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "axes_dims_rope": [4, 6, 6],
    },
    "vae": {
        **QWEN_IMAGE_VAE, "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
        "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4,
    },
    "text_encoder": {
        "text_config": {
            **_QWEN25_VL_7B["text_config"], "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        },
        "vision_config": {
            **_QWEN25_VL_7B["vision_config"], "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": 32, "fullatt_block_indexes": [0],
        },
        "tie_word_embeddings": False,
    },
    "tokenizer": {"kind": "qwen-image", "max_length": 32},
    "scheduler": QWEN_IMAGE_SCHEDULER,
    "objective": {"max_sequence_length": 32, "pad_token_id": 256},
}  # fmt: skip
