"""The batch schema: every key a batch may carry, at the bottom of the package.

Models read these keys, datasets (data/) write them, and nothing imports a model file or a dataset file
for a key. A family declares which of them its batches carry in ``batch_shapes`` (models/base.py).

Online batches (images decoded and tokenized on the fly):
    IMAGE            (B, 3, H, W) float in [-1, 1]
    INPUT_IDS        (B, L) long: CLIP token ids (SD's only text input; FLUX's pooled-embedding input)
    T5_INPUT_IDS     (B, L') long: T5 token ids (FLUX's sequence-embedding input)
Precomputed batches (data.py precompute: the frozen encoders ran once, ahead of training):
    LATENT_MOMENTS   (B, 2C, h, w): the VAE posterior's mean and log-variance, sampled every step
    LATENTS          (B, C, h, w): latents as they are (unscaled), when no posterior is kept
    TEXT_EMBEDS      (B, L, D): the text encoder's sequence output
    POOLED_TEXT_EMBEDS (B, D'): FLUX's pooled CLIP embedding
Validation batches may add:
    SAMPLE_ID        (B,) long: the sample's index in its dataset (fixed per-sample noise)
    TIMESTEP_INDEX   (B,) long: FLUX's fixed validation timestep bin (MLPerf: t = k / 8)
"""

IMAGE = "image"
INPUT_IDS = "input_ids"
T5_INPUT_IDS = "t5_input_ids"
LATENT_MOMENTS = "latent_moments"
LATENTS = "latents"
TEXT_EMBEDS = "text_embeds"
POOLED_TEXT_EMBEDS = "pooled_text_embeds"
SAMPLE_ID = "sample_id"
TIMESTEP_INDEX = "timestep_index"
