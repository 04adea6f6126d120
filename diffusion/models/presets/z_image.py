"""Z-Image (family "z-image", z_image.py): its presets, as data (presets/__init__.py assembles every module's)."""

from __future__ import annotations

from diffusion.models.presets.flux import FLUX_VAE
from diffusion.models.presets.flux import PRESETS as FLUX_PRESETS
from diffusion.models.presets.flux2 import QWEN3_4B

PRESETS: dict[str, dict] = {}

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
    "vae": FLUX_VAE,
    "text_encoder": QWEN3_4B,
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
    "vae": FLUX_PRESETS["flux-tiny"]["vae"],
    "text_encoder": {
        **QWEN3_4B, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    },
    "tokenizer": {"kind": "chat", "max_length": 64},
    "scheduler": Z_IMAGE_SCHEDULER,
    "objective": {"max_sequence_length": 64, "pad_token_id": 256},
}  # fmt: skip
