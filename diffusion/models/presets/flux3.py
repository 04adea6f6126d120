"""FLUX.3 (families "flux3" and "flux3-distilled", flux3.py): its presets, as data (presets/__init__.py assembles every
module's)."""

from __future__ import annotations

from diffusion.models.presets.flux2 import FLUX2_VAE
from diffusion.models.presets.flux2 import PRESETS as FLUX2_PRESETS
from diffusion.models.presets.krea2 import QWEN3_VL_4B  # Qwen3-VL-4B-Instruct's config, Krea 2's text encoder too

PRESETS: dict[str, dict] = {}

# FLUX.3 [klein] (family "flux3", flux3.py; Flux3ModularPipeline). The transformer's numbers are diffusers 0.42.1's
# Flux3Transformer2DModel defaults, the configuration of black-forest-labs/flux-3-image-klein-base (single_file_utils'
# "flux-3-image" default repo): 5 per-mode blocks for each of the image, reference-image and text modes, then 28 joint
# single blocks, width 24 heads x 128 = 3072, 128 input channels (32 latent channels x 2x2), the text width eight
# stacked Qwen3-VL layers' (8 x 2560 = 20480: Flux3TextEncoderStep's text_encoder_out_layers 4, 8, ..., 32), RoPE
# over (t, h, w, l) 4 x 32 at theta 10000. The step-distilled black-forest-labs/flux-3-image-klein
# ("flux-3-image-distilled") is the same with flow_map=True (its target_timestep_embedder). The text encoder is
# Qwen3-VL-4B-Instruct (Qwen/Qwen3-VL-4B-Instruct config.json: 36 layers of 2560, its 24-block vision tower unused),
# the VAE FLUX.2's AutoencoderKLFlux2 at its class defaults. The scheduler is Flux3SetTimestepsStep's: flow-matching
# Euler with the constant shift 6.93.
FLUX3_TRANSFORMER = {
    "in_channels": 128,
    "cond_in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 20480,
    "timestep_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 10000,
    "eps": 1e-6,
    "flow_map": False,
}
FLUX3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.93, "use_dynamic_shifting": False}
PRESETS["flux3"] = {
    # 5.54B transformer (the reference-image mode's embedder, modulations and 5 blocks, 0.67B, frozen in text-to-image training, included),
    # Qwen3-VL-4B text encoder (4.44B with its vision tower); 1024 px (Flux3PrepareLatentsStep's default), captions of up to 512
    # tokens (the pipeline's own cap is 8192; each caption takes its 80-token window, flux3.py)
    "family": "flux3",
    "resolution": 1024,
    "transformer": FLUX3_TRANSFORMER,
    "vae": FLUX2_VAE,
    "text_encoder": QWEN3_VL_4B,
    "tokenizer": {"kind": "chat", "max_length": 512},
    "scheduler": FLUX3_SCHEDULER,
    "objective": {"max_sequence_length": 512, "pad_token_id": 256},  # the chat tokenizer pads with 256
}
PRESETS["flux3-distilled"] = {
    # the step-distilled model (Flux3DistilledModularPipeline: 16 steps, no guidance): a flow map
    **PRESETS["flux3"],
    "family": "flux3-distilled",
    "transformer": {**FLUX3_TRANSFORMER, "flow_map": True},
}
PRESETS["flux3-tiny"] = {
    # FLUX.3's layout at CPU size: 1 per-mode block a mode and 2 joint blocks of width 32 (2 heads x 16), a 32-layer
    # Qwen3-VL 32 wide (layers 4, 8, ..., 32 are the pipeline's, so an exported folder samples with its defaults; a
    # 1-block vision tower beside it, unused), flux2-tiny's VAE (4 channels); captions of one 80-token window
    "family": "flux3",
    "resolution": 64,
    "transformer": {
        **FLUX3_TRANSFORMER, "in_channels": 16, "cond_in_channels": 16, "num_layers": 1, "num_single_layers": 2,
        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 256, "timestep_channels": 32,
        "axes_dims_rope": [4, 4, 4, 4],
    },
    "vae": FLUX2_PRESETS["flux2-tiny"]["vae"],
    "text_encoder": {
        "text_config": {
            **QWEN3_VL_4B["text_config"], "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 256,
            "rope_scaling": {**QWEN3_VL_4B["text_config"]["rope_scaling"], "mrope_section": [2, 1, 1]},
        },
        "vision_config": {
            **QWEN3_VL_4B["vision_config"], "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": 32, "deepstack_visual_indexes": [0],
        },
        "tie_word_embeddings": True,
    },
    "tokenizer": {"kind": "chat", "max_length": 80},
    "scheduler": FLUX3_SCHEDULER,
    "objective": {"max_sequence_length": 80, "pad_token_id": 256},
}  # fmt: skip
PRESETS["flux3-distilled-tiny"] = {
    # flux3-tiny as a flow map (the distilled layout's target_timestep_embedder)
    **PRESETS["flux3-tiny"],
    "family": "flux3-distilled",
    "transformer": {**PRESETS["flux3-tiny"]["transformer"], "flow_map": True},
}
