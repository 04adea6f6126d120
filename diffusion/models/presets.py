"""Named model presets, as data.

A preset maps a name to the configs of its parts. Adding an architecture is a new entry here, not a new
function: ``build.py`` turns any entry into modules. Every preset builds offline with random
weights; pretrained weights come from a local diffusers pipeline directory instead (``--model_name DIR``).

Part keys are the folder names of the matching diffusers pipeline, so a preset and a local pipeline
directory describe a model the same way. Every diffusion preset has:
  family          "sd" (latent UNet, DDPM noise schedule), "sdxl" (the same, conditioned as SDXL is),
                  "flux" (rectified-flow transformer) or "vae" (an autoencoder to train: only ``vae`` and
                  ``resolution``)
  resolution      native image size in pixels (the default ``--image_size``)
  vae             diffusers ``AutoencoderKL`` config
  text_encoder    transformers ``CLIPTextConfig`` kwargs
  tokenizer       {"kind": "clip", "max_length": N}: an offline tokenizer (see tokenizer.py: "clip" for CLIP
                  towers, "t5" for T5, "chat" / "qwen-image" for Qwen)
  scheduler       the sampling scheduler's config
SD adds ``unet`` (``UNet2DConditionModel`` config; ``scheduler`` is the DDPM training schedule, with
``prediction_type`` epsilon or v_prediction). SDXL adds to SD's ``text_encoder_2`` (``CLIPTextConfig`` kwargs of
a CLIPTextModelWithProjection) and ``tokenizer_2``; its ``unet`` has ``addition_embed_type`` "text_time". FLUX adds ``transformer`` (``FluxTransformer2DModel``
config), ``text_encoder_2`` (``T5Config`` kwargs), ``tokenizer_2`` and ``objective`` (flux.py's
OBJECTIVE_DEFAULTS: timestep sampling, shift, text dropout, T5 length).
"""

from __future__ import annotations

import copy

# Stable Diffusion 2 noise schedule (scaled-linear betas, 1000 steps).
_SD2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "prediction_type": "epsilon",
    "steps_offset": 1,
}

# The clip tokenizer's ids (tokenizer.py): CLIPTextModel pools at the eos token, so every CLIP text config names them
_CLIP_IDS = {"bos_token_id": 486, "eos_token_id": 487, "pad_token_id": 487}

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
            **_CLIP_IDS,
        },
        "tokenizer": {"kind": "clip", "max_length": 77},
        "scheduler": _SD2_SCHEDULER,
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
            **_CLIP_IDS,
        },
        "tokenizer": {"kind": "clip", "max_length": 77},
        "scheduler": _SD2_SCHEDULER,
    },
}


# FLUX.1 parts: the 16-channel f8 autoencoder, CLIP-L (pooled) and T5-XXL v1.1 (sequence).
_FLUX_VAE = {
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
_CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    **_CLIP_IDS,
}
_T5_XXL = {
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
    "vae": _FLUX_VAE,
    "text_encoder": _CLIP_L,
    "text_encoder_2": _T5_XXL,
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
    "vae": {**PRESETS["sd-tiny"]["vae"], "shift_factor": 0.1, "scaling_factor": 0.5},
    "text_encoder": PRESETS["sd-tiny"]["text_encoder"],
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
_OPENCLIP_BIGG = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1280,
    **_CLIP_IDS,
}
_SDXL_TOKENIZERS_AND_SCHEDULER = {
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "clip", "max_length": 77},
    "scheduler": {**_SD2_SCHEDULER, "timestep_spacing": "leading"},  # SDXL's published schedule
}

PRESETS["sdxl-base"] = {
    "family": "sdxl",
    "resolution": 1024,
    "unet": _SDXL_UNET,
    "vae": {**PRESETS["sd2-base"]["vae"], "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    "text_encoder": _CLIP_L,
    "text_encoder_2": _OPENCLIP_BIGG,
    **_SDXL_TOKENIZERS_AND_SCHEDULER,
}
PRESETS["sdxl-tiny"] = {
    # The same layout (no attention at the first level, a deeper transformer at the second, two towers) at a
    # size where a CPU trains a step in a fraction of a second at 64 px.
    "family": "sdxl",
    "resolution": 64,
    "unet": {  # sd-tiny's UNet, with SDXL's block layout and added conditioning
        **PRESETS["sd-tiny"]["unet"],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "transformer_layers_per_block": [1, 2],
        "attention_head_dim": [4, 8],
        "cross_attention_dim": 64,  # 32 + 32
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 80,  # 32 + 6 x 8
    },
    "vae": {**PRESETS["sd-tiny"]["vae"], "scaling_factor": 0.13025},
    "text_encoder": PRESETS["sd-tiny"]["text_encoder"],
    "text_encoder_2": {**PRESETS["sd-tiny"]["text_encoder"], "hidden_act": "gelu", "num_attention_heads": 2},
    **_SDXL_TOKENIZERS_AND_SCHEDULER,
}

# Stable Diffusion 3.5 (family "sd3", sd3.py): an MMDiT of joint blocks (2x2 patches of 16-channel f8 latents), CLIP-L
# and OpenCLIP-bigG (both with projection: pooled 768 + 1280 = 2048) and T5-XXL (4096: the joint attention's context),
# SD3's VAE (SD's f8 layout, 16 channels, scaling 1.5305, shift 0.0609) and the flow-matching scheduler (shift 3.0).
# Transformer numbers: the published transformer/config.json of stabilityai/stable-diffusion-3.5-medium and
# stabilityai/stable-diffusion-3.5-large; the VAE's: their vae/config.json.
_SD3_VAE = {**_FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
_SD3_FLOW_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_SD3_PARTS = {
    "family": "sd3",
    "resolution": 1024,
    "vae": _SD3_VAE,
    "text_encoder": _CLIP_L,
    "text_encoder_2": _OPENCLIP_BIGG,
    "text_encoder_3": _T5_XXL,
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
    "vae": PRESETS["flux-tiny"]["vae"],
    "text_encoder": PRESETS["sd-tiny"]["text_encoder"],
    "text_encoder_2": PRESETS["sdxl-tiny"]["text_encoder_2"],
    "text_encoder_3": {**PRESETS["flux-tiny"]["text_encoder_2"], "d_model": 96, "d_ff": 128},
    "tokenizer": {"kind": "clip", "max_length": 77},
    "tokenizer_2": {"kind": "clip", "max_length": 77},
    "tokenizer_3": {"kind": "t5", "max_length": 32},
    "scheduler": _SD3_FLOW_SCHEDULER,
    "objective": {"max_sequence_length": 32},
}

# Autoencoders to train (family "vae", autoencoder.py): the diffusion models above take the result with
# vae=DIR. Only ``vae`` and ``resolution`` apply.
PRESETS["sd-vae"] = {
    # SD's f8, 4-channel KL autoencoder (83.7M), to train on your own domain.
    "family": "vae",
    "resolution": 256,
    "vae": PRESETS["sd2-base"]["vae"],
}
PRESETS["vae-tiny"] = {
    # f2, 4 channels: small images on a CPU (the digits example trains it in about a minute).
    "family": "vae",
    "resolution": 16,
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 1,
        "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
        "norm_num_groups": 8,
        "sample_size": 16,
        "scaling_factor": 1.0,
    },
}

PRESETS["vae-flux2-tiny"] = {
    # vae-tiny's layout as FLUX.2's class (its quant convs, and the batch norm whose running statistics the flux2
    # family normalises the 2x2-patchified latents with): f2, 4 channels, for flux2-tiny (16 patch channels)
    "family": "vae",
    "resolution": 16,
    "vae": {
        "_class_name": "AutoencoderKLFlux2",
        **{k: v for k, v in PRESETS["vae-tiny"]["vae"].items() if k != "scaling_factor"},
        "batch_norm_eps": 1e-4,
        "patch_size": [2, 2],
    },
}
PRESETS["vae-qwen-image-tiny"] = {
    # Qwen-Image's causal 3D VAE (fed one frame) at f2 (one spatial downsampling, none in time), 4 channels, for
    # qwen-image-tiny; latents_mean/std are measured in training
    "family": "vae",
    "resolution": 16,
    "vae": {
        "_class_name": "AutoencoderKLQwenImage",
        "base_dim": 16,
        "z_dim": 4,
        "dim_mult": [1, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False],
        "dropout": 0.0,
        "latents_mean": [0.0] * 4,
        "latents_std": [1.0] * 4,
    },
}


# FLUX.2 [klein] (family "flux2", flux2.py; Flux2KleinPipeline). The transformers' numbers are those of
# black-forest-labs/FLUX.2-klein-4B and -9B transformer/config.json (as diffusers' scripts/convert_flux2_to_diffusers.py
# writes them for klein-4b and klein-9b): width 24 (4B) or 32 (9B) heads x 128, 5 + 20 or 8 + 24 blocks, 128 input
# channels (32 latent channels x 2x2), the text width three Qwen3 layers' (3 x 2560, 3 x 4096), no guidance embedding.
# The text encoders are Qwen3-4B and Qwen3-8B (Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json), the VAE AutoencoderKLFlux2
# at its class defaults (f8, 32 channels, a batch norm over the 128 patch channels).
_FLUX2_TRANSFORMER = {
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
_FLUX2_VAE = {  # FLUX.1's VAE layout, 32 channels, with its quant convs
    **{k: v for k, v in _FLUX_VAE.items() if k not in ("scaling_factor", "shift_factor", "use_quant_conv",
                                                        "use_post_quant_conv")},
    "latent_channels": 32,
    "batch_norm_eps": 1e-4,
    "patch_size": [2, 2],
}  # fmt: skip
_QWEN3_4B = {
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
    "transformer": _FLUX2_TRANSFORMER,
    "vae": _FLUX2_VAE,
    "text_encoder": _QWEN3_4B,
    "tokenizer": {"kind": "chat", "max_length": 512},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the chat tokenizer pads with 256
}
PRESETS["flux2-klein-9b"] = {
    # 9B transformer, Qwen3-8B text encoder (its embeddings untied)
    **PRESETS["flux2-klein-4b"],
    "transformer": {
        **_FLUX2_TRANSFORMER, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
        "joint_attention_dim": 12288,
    },
    "text_encoder": {**_QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
}  # fmt: skip
PRESETS["flux2-tiny"] = {
    # klein's layout at CPU size: 1 double + 2 single blocks of width 32, a 27-layer Qwen3 32 wide (layers 9, 18 and
    # 27 are the pipeline's, so an exported folder samples with its defaults), sd-tiny's VAE shape with 4 channels
    "family": "flux2",
    "resolution": 64,
    "transformer": {
        **_FLUX2_TRANSFORMER, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 96, "timestep_guidance_channels": 32,
        "axes_dims_rope": [4, 4, 4, 4],
    },
    "vae": {
        **_FLUX2_VAE, "latent_channels": 4, "layers_per_block": 1, "block_out_channels": [8, 16, 16, 16],
        "norm_num_groups": 8, "sample_size": 64,
    },
    "text_encoder": {
        **_QWEN3_4B, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 27,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    },
    "tokenizer": {"kind": "chat", "max_length": 64},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256},
}  # fmt: skip


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
        **_FLUX2_TRANSFORMER, "num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48,
        "joint_attention_dim": 15360, "guidance_embeds": True,
    },
    "vae": _FLUX2_VAE,
    "text_encoder": _MISTRAL_SMALL_31,
    "tokenizer": {"kind": "mistral", "max_length": 512},
    "scheduler": FLUX2_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 266},  # the mistral kind pads with <pad>, 266
}  # fmt: skip
PRESETS["flux2-dev-tiny"] = {
    # dev's layout at CPU size: flux2-tiny's transformer with a guidance embedding, a 30-layer Mistral 32 wide (layers
    # 10, 20 and 30 are the pipeline's, so an exported folder samples with its defaults) beside a 1-layer Pixtral
    # tower (unused), flux2-tiny's VAE; 96 caption tokens (the system message's 49 and the caption)
    **PRESETS["flux2-tiny"],
    "family": "flux2-dev",
    "transformer": {**PRESETS["flux2-tiny"]["transformer"], "guidance_embeds": True},
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

# Z-Image (family "z-image", z_image.py; ZImagePipeline). The transformer's numbers are those of Tongyi-MAI/Z-Image-Turbo
# transformer/config.json (Tongyi-MAI/Z-Image publishes the same, key for key): 30 single-stream blocks and 2 + 2
# refiner blocks of width 3840 (30 heads x 128), 2x2 patches of 16 latent channels, captions 2560 wide (Qwen3-4B's
# width). The text encoder is Qwen3-4B (its text_encoder/config.json: Qwen/Qwen3-4B's), the VAE FLUX.1's (vae/config.json:
# scaling 0.3611, shift 0.1159), the scheduler Z-Image-Turbo's scheduler_config.json (shift 3.0, no dynamic shifting;
# Z-Image's base checkpoint publishes shift 6.0).
_Z_IMAGE_TRANSFORMER = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
PRESETS["z-image"] = {
    # 6.15B transformer, Qwen3-4B text encoder; 1024 px, 512 caption tokens (the pipeline's defaults)
    "family": "z-image",
    "resolution": 1024,
    "transformer": _Z_IMAGE_TRANSFORMER,
    "vae": _FLUX_VAE,
    "text_encoder": _QWEN3_4B,
    "tokenizer": {"kind": "chat", "max_length": 512},
    "scheduler": Z_IMAGE_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the chat tokenizer pads with 256
}
PRESETS["z-image-tiny"] = {
    # Z-Image's layout at CPU size: 2 single-stream blocks and 1 + 1 refiner blocks of width 32 (2 heads x 16), a
    # 3-layer Qwen3 32 wide (the states before its last layer, as the pipeline reads them), flux-tiny's VAE (4 channels)
    "family": "z-image",
    "resolution": 64,
    "transformer": {
        **_Z_IMAGE_TRANSFORMER, "in_channels": 4, "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2,
        "n_kv_heads": 2, "cap_feat_dim": 32, "axes_dims": [4, 6, 6],
    },
    "vae": PRESETS["flux-tiny"]["vae"],
    "text_encoder": {
        **_QWEN3_4B, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    },
    "tokenizer": {"kind": "chat", "max_length": 64},
    "scheduler": Z_IMAGE_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256},
}  # fmt: skip


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
_QWEN_IMAGE_VAE = {
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
    "vae": _QWEN_IMAGE_VAE,
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
        **_QWEN_IMAGE_VAE, "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
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


def get_preset(name: str) -> dict:
    """A deep copy of preset ``name`` (callers may edit it freely)."""
    if name not in PRESETS:
        raise KeyError(name)
    return copy.deepcopy(PRESETS[name])
