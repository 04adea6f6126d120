"""The batch schema: every key a batch may carry, at the bottom of the package.

Models read these keys, datasets (data/) write them, and nothing imports a model file or a dataset file
for a key. A family declares which of them its batches carry in ``batch_shapes`` (models/base.py).

Online batches (images decoded and tokenized on the fly):
    IMAGE            (B, 3, H, W) float in [-1, 1]
    INPUT_IDS        (B, L) long: CLIP token ids (SD's only text input; FLUX's pooled-embedding input)
    T5_INPUT_IDS     (B, L') long: T5 token ids (FLUX's sequence-embedding input)
    INPUT_IDS_2      (B, L) long: the second CLIP tokenizer's ids (SDXL's OpenCLIP-bigG input)
Size and crop conditioning (SDXL's micro-conditioning; online and precomputed batches alike):
    ORIGINAL_SIZE    (B, 2) long: (height, width) of the image before any resize or crop: the dataset's
                     original_height/original_width columns, else the stored image's size
    CROP_TOP_LEFT    (B, 2) long: (top, left) of the crop, in pixels of the image resized so that the crop
                     is the target size (the square crop: its shorter side at the image size), as in the
                     SDXL paper and diffusers' SDXL training script; after a flip, measured on the flipped
                     image. An aspect-ratio bucketing transform fills the same keys; the third SDXL time
                     id, the target size, is the batch's own image size (H, W), so it has no key
Precomputed batches (data.py precompute: the frozen encoders ran once, ahead of training):
    LATENT_MOMENTS   (B, 2C, h, w): the VAE posterior's mean and log-variance, sampled every step
    LATENTS          (B, C, h, w): latents as they are (unscaled), when no posterior is kept
    TEXT_EMBEDS      (B, L, D): the text encoder's sequence output (SDXL: both encoders' penultimate
                     hidden states, concatenated)
    POOLED_TEXT_EMBEDS (B, D'): the pooled text embedding (FLUX: CLIP's; SDXL: OpenCLIP-bigG's projection)
    REPA_FEATURES    (B, E, rows, cols): REPA's frozen vision encoder's patch features of the clean image, on
                     the encoder's own grid (data.py precompute --repa_encoder DIR); read only by a run with
                     repa_encoder set, which then loads no encoder (diffusion/techniques/repa/alignment.py)
Validation batches may add:
    SAMPLE_ID        (B,) long: the sample's index in its dataset (fixed per-sample noise)
    TIMESTEP_INDEX   (B,) long: FLUX's fixed validation timestep bin (MLPerf: t = k / 8)
"""

IMAGE = "image"
INPUT_IDS = "input_ids"
T5_INPUT_IDS = "t5_input_ids"
INPUT_IDS_2 = "input_ids_2"
ORIGINAL_SIZE = "original_size"
CROP_TOP_LEFT = "crop_top_left"
LATENT_MOMENTS = "latent_moments"
LATENTS = "latents"
TEXT_EMBEDS = "text_embeds"
POOLED_TEXT_EMBEDS = "pooled_text_embeds"
REPA_FEATURES = "repa_features"
REPA_RECORD = "repa_features.json"  # beside a precomputed index: the record of the encoder whose features it holds
SAMPLE_ID = "sample_id"
TIMESTEP_INDEX = "timestep_index"
