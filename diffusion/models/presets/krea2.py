"""Krea 2 (family "krea2", krea2.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.qwen_image import PRESETS as QWEN_IMAGE_PRESETS
from diffusion.models.presets.qwen_image import QWEN_IMAGE_VAE

PRESETS: dict[str, dict] = {}

# Krea 2 (family "krea2", krea2.py; Krea2Pipeline). The transformer's numbers are Krea2Transformer2DModel's defaults in
# diffusers 0.42.1, which its docstring gives as Krea 2's (the Base and the Turbo checkpoint share them; the model
# cards: "single-stream DiT, 12.9B parameters, 28 blocks at width 6144"): 28 blocks of 48 query heads x 128 with 12
# key/value heads, SwiGLU 16384, 64 input channels (16 latent channels x 2x2), a text fusion of 2 + 2 blocks over 12
# tapped Qwen3-VL-4B layers of 2560. The VAE is Qwen-Image's (Krea2Pipeline's AutoencoderKLQwenImage); the text
# encoder Qwen3-VL-4B-Instruct (its config.json: a 36-layer Qwen3 text model of 2560 with interleaved mRoPE, a
# 24-block vision tower, unused); the scheduler the resolution-aware exponential shift Krea2Pipeline's docstring
# asks for (base 0.5 at 256 image tokens, max 1.15 at 6400).
_KREA2_TRANSFORMER = {
    "in_channels": 64,
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "intermediate_size": 16384,
    "timestep_embed_dim": 256,
    "text_hidden_dim": 2560,
    "num_text_layers": 12,
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48],
    "rope_theta": 1000.0,
    "norm_eps": 1e-5,
}
QWEN3_VL_4B = {
    "text_config": {
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 5000000, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2560,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh",
    },
    "tie_word_embeddings": True,
}  # fmt: skip
KREA2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
    "time_shift_type": "exponential",
}
PRESETS["krea2"] = {
    # 12.9B transformer, Qwen3-VL-4B text encoder (4.4B with its vision tower); 1024 px, 512 caption states (the
    # pipeline's defaults)
    "family": "krea2",
    "resolution": 1024,
    "transformer": _KREA2_TRANSFORMER,
    "vae": QWEN_IMAGE_VAE,
    "text_encoder": QWEN3_VL_4B,
    "tokenizer": {"kind": "qwen-image", "max_length": 512},
    "scheduler": KREA2_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the offline tokenizer pads with 256
}
PRESETS["krea2-tiny"] = {
    # Krea 2's layout at CPU size: 2 blocks of width 32 (2 query heads x 16, 1 key/value head), a text fusion of 1 + 1
    # blocks over 6 tapped layers (every layer of a 6-layer Qwen3-VL 32 wide, its vision tower 1 block), Qwen-Image
    # tiny's VAE (4 channels, f8: 64 px -> 4 x 4 tokens)
    "family": "krea2",
    "resolution": 64,
    "transformer": {
        **_KREA2_TRANSFORMER, "in_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 64, "timestep_embed_dim": 32, "text_hidden_dim": 32,
        "num_text_layers": 6, "text_num_attention_heads": 2, "text_num_key_value_heads": 2, "text_intermediate_size": 64,
        "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1, "axes_dims_rope": [4, 6, 6],
    },
    "vae": QWEN_IMAGE_PRESETS["qwen-image-tiny"]["vae"],
    "text_encoder": {
        "text_config": {
            **QWEN3_VL_4B["text_config"], "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 256,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        },
        "vision_config": {
            **QWEN3_VL_4B["vision_config"], "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": 32, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        "tie_word_embeddings": True,
    },
    "tokenizer": {"kind": "qwen-image", "max_length": 64},
    "scheduler": KREA2_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256, "text_layers": [1, 2, 3, 4, 5, 6]},
}  # fmt: skip
