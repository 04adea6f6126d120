"""FLUX.2 [klein] (family "flux2", flux2.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.flux import FLUX_VAE

PRESETS: dict[str, dict] = {}

# FLUX.2 [klein] (family "flux2", flux2.py; Flux2KleinPipeline). The transformers' numbers are those of
# black-forest-labs/FLUX.2-klein-4B and -9B transformer/config.json (as diffusers' scripts/convert_flux2_to_diffusers.py
# writes them for klein-4b and klein-9b): width 24 (4B) or 32 (9B) heads x 128, 5 + 20 or 8 + 24 blocks, 128 input
# channels (32 latent channels x 2x2), the text width three Qwen3 layers' (3 x 2560, 3 x 4096), no guidance embedding.
# The text encoders are Qwen3-4B and Qwen3-8B (Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json), the VAE AutoencoderKLFlux2
# at its class defaults (f8, 32 channels, a batch norm over the 128 patch channels).
FLUX2_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
FLUX2_VAE = {  # FLUX.1's VAE layout, 32 channels, with its quant convs
    **{k: v for k, v in FLUX_VAE.items() if k not in ("scaling_factor", "shift_factor", "use_quant_conv",
                                                        "use_post_quant_conv")},
    "latent_channels": 32,
    "batch_norm_eps": 1e-4,
    "patch_size": [2, 2],
}  # fmt: skip
QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
}
# Flux2KleinPipeline's sampling schedule: it passes mu (compute_empirical_mu), which needs dynamic shifting; training
# draws its own t (the objective), not from this
FLUX2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}
PRESETS["flux2-klein-4b"] = {
    # 3.9B transformer, Qwen3-4B text encoder; 1024 px, 512 caption tokens (the pipeline's defaults)
    "family": "flux2",
    "resolution": 1024,
    "transformer": FLUX2_TRANSFORMER,
    "vae": FLUX2_VAE,
    "text_encoder": QWEN3_4B,
    "tokenizer": {"kind": "chat", "max_length": 512},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the chat tokenizer pads with 256
}
PRESETS["flux2-klein-9b"] = {
    # 9B transformer, Qwen3-8B text encoder (its embeddings untied)
    **PRESETS["flux2-klein-4b"],
    "transformer": {
        **FLUX2_TRANSFORMER, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
        "joint_attention_dim": 12288,
    },
    "text_encoder": {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
}  # fmt: skip
PRESETS["flux2-tiny"] = {
    # klein's layout at CPU size: 1 double + 2 single blocks of width 32, a 27-layer Qwen3 32 wide (layers 9, 18 and
    # 27 are the pipeline's, so an exported folder samples with its defaults), sd-tiny's VAE shape with 4 channels
    "family": "flux2",
    "resolution": 64,
    "transformer": {
        **FLUX2_TRANSFORMER, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 96, "timestep_guidance_channels": 32,
        "axes_dims_rope": [4, 4, 4, 4],
    },
    "vae": {
        **FLUX2_VAE, "latent_channels": 4, "layers_per_block": 1, "block_out_channels": [8, 16, 16, 16],
        "norm_num_groups": 8, "sample_size": 64,
    },
    "text_encoder": {
        **QWEN3_4B, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 27,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    },
    "tokenizer": {"kind": "chat", "max_length": 64},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256},
}  # fmt: skip
