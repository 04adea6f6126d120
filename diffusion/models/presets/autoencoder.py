"""The autoencoders to train (family "vae", autoencoder.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.sd import PRESETS as SD_PRESETS

PRESETS: dict[str, dict] = {}

# Autoencoders to train (family "vae", autoencoder.py): the diffusion models above take the result with
# vae=DIR. Only ``vae`` and ``resolution`` apply.
PRESETS["sd-vae"] = {
    # SD's f8, 4-channel KL autoencoder (83.7M), to train on your own domain.
    "family": "vae",
    "resolution": 256,
    "vae": SD_PRESETS["sd2-base"]["vae"],
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
