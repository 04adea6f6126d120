"""Qwen-Image 2.1 (family "qwen-image-21", qwen_image21.py): its presets, as data (presets/__init__.py assembles every
module's)."""

from __future__ import annotations

from diffusion.models.presets.krea2 import PRESETS as KREA2_PRESETS
from diffusion.models.presets.krea2 import QWEN3_VL_4B

PRESETS: dict[str, dict] = {}

# Qwen-Image 2.1 (QwenImage21Pipeline). The transformer's numbers are QwenImage21Transformer2DModel's defaults in
# diffusers 0.42.1, which its docstring gives as 2.1's (the Base and the Turbo checkpoint share them: the Turbo one
# differs by its weights and the sampling grid its model_index.json records, sample_sigmas): 32 single-stream blocks
# of 32 heads x 128, SwiGLU 3 x 4096, 64 latent channels taken unpatched, text states of 4096, RoPE (16, 56, 56),
# causal_condition. The VAE is AutoencoderKLQwenImage21's defaults (64 channels, 16x spatial compression, RGBA in and
# out, per-channel latents_mean / latents_std). The text encoder is Qwen3-VL-8B-Instruct (stable-diffusion.cpp's and
# ComfyUI's Qwen-Image 2.1 guides; its config.json: a 36-layer Qwen3 text model of 4096 with interleaved mRoPE and
# untied embeddings, a 27-block vision tower of 1152). The scheduler is the resolution-dependent exponential shift
# QwenImage21Pipeline computes mu for, at the line it reads when the config leaves it out (256 -> 0.5, 4096 -> 1.15).
_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "context_in_dim": 4096,
    "mlp_ratio": 3,
    "axes_dims_rope": [16, 56, 56],
    "causal_condition": True,
}
QWEN_IMAGE_21_VAE = {
    "base_dim": 96,
    "decoder_base_dim": 144,
    "z_dim": 64,
    "dim_mult": [1, 2, 4, 8, 8],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True, True],
    "in_channels": 4,
    "out_channels": 4,
}
QWEN3_VL_8B = {  # Qwen3-VL-4B's layout (Krea 2's text encoder) at 8B's sizes
    "text_config": {
        **QWEN3_VL_4B["text_config"], "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False,
    },
    "vision_config": {
        **QWEN3_VL_4B["vision_config"], "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
        "out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24],
    },
    "tie_word_embeddings": False,
}  # fmt: skip
QWEN_IMAGE_21_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}
PRESETS["qwen-image-21"] = {
    # 7.12B transformer, Qwen3-VL-8B text encoder (8.8B with its vision tower); 1024 px (the pipeline's
    # output_resolution), captions of up to 512 states (the pipeline pads to the longest caption of a batch)
    "family": "qwen-image-21",
    "resolution": 1024,
    "transformer": _TRANSFORMER,
    "vae": QWEN_IMAGE_21_VAE,
    "text_encoder": QWEN3_VL_8B,
    "processor": {"kind": "qwen-image-21", "max_length": 512},
    "scheduler": QWEN_IMAGE_21_SCHEDULER,
    # the offline tokenizer pads with 256; its system message is 12 tokens
    "objective": {"max_sequence_length": 512, "pad_token_id": 256, "system_tokens": 12},
}
PRESETS["qwen-image-21-tiny"] = {
    # Qwen-Image 2.1's layout at CPU size: 2 blocks of width 32 (2 heads x 16), a VAE of 16 channels that still
    # compresses 16x (the pipeline's fixed vae_scale_factor: 64 px -> 4 x 4 tokens), Krea 2 tiny's 6-layer Qwen3-VL
    "family": "qwen-image-21",
    "resolution": 64,
    "transformer": {
        **_TRANSFORMER, "in_channels": 16, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "context_in_dim": 32, "axes_dims_rope": [4, 6, 6],
    },
    "vae": {
        **QWEN_IMAGE_21_VAE, "base_dim": 8, "decoder_base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 2, 2, 2],
        "num_res_blocks": 1, "latents_mean": [(-1) ** i * 0.1 * (i % 5) for i in range(16)],
        "latents_std": [1.0 + 0.1 * (i % 3) for i in range(16)],
    },
    "text_encoder": KREA2_PRESETS["krea2-tiny"]["text_encoder"],
    "processor": {"kind": "qwen-image-21", "max_length": 64},
    "scheduler": QWEN_IMAGE_21_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256, "system_tokens": 12},
}  # fmt: skip
