"""SDXL as a model family: its conditioning (two text towers, pooled embedding, size/crop time ids from the
data), training, precompute, export to a StableDiffusionXLPipeline and back, and the published preset's size."""

import io
import json

import numpy as np
import pytest
import torch
from conftest import REPO, read_mds
from PIL import Image
from torch.utils.data import default_collate

import benchmark
from diffusion.batch import CROP_TOP_LEFT, INPUT_IDS_2, ORIGINAL_SIZE, POOLED_TEXT_EMBEDS, TEXT_EMBEDS
from diffusion.data.synthetic import SyntheticDataset
from diffusion.data.transforms import ImageTransform
from diffusion.errors import UsageError
from diffusion.models import StableDiffusionXL, build_model, describe
from diffusion.precompute import precompute


@pytest.fixture(scope="module")
def sdxl_tiny():
    torch.manual_seed(0)
    return build_model("sdxl-tiny")


def _batch(model, n=4, precomputed=False, seed=0):
    ds = SyntheticDataset(model.batch_shapes(64, precomputed), num_samples=n, pool=n, seed=seed)
    return default_collate([ds[i] for i in range(n)])


def test_conditioning_is_sdxls(sdxl_tiny):
    model = sdxl_tiny.model
    assert set(sdxl_tiny.tokenizers) == {"input_ids", "input_ids_2"}
    batch = _batch(model)
    assert (batch[ORIGINAL_SIZE] >= 32).all() and (batch[CROP_TOP_LEFT] <= 16).all()  # plausible synthetic sizes
    latents = model.encode_latents(batch)
    cond = model.conditioning(batch, latents)
    one = model.text_encoder(batch["input_ids"], output_hidden_states=True).hidden_states[-2]
    two = model.text_encoder_2(batch["input_ids_2"], output_hidden_states=True)
    torch.testing.assert_close(cond["encoder_hidden_states"], torch.cat([one, two.hidden_states[-2]], -1))
    torch.testing.assert_close(cond["added_cond_kwargs"]["text_embeds"], two.text_embeds)
    ids = cond["added_cond_kwargs"]["time_ids"]
    assert ids.shape == (4, 6) and ids[:, 4:].eq(64).all()  # target size: the image's
    torch.testing.assert_close(ids[:, :4], torch.cat([batch[ORIGINAL_SIZE], batch[CROP_TOP_LEFT]], 1).float())
    no_sizes = {k: v for k, v in batch.items() if k not in (ORIGINAL_SIZE, CROP_TOP_LEFT)}  # as the pipeline samples
    assert model.conditioning(no_sizes, latents)["added_cond_kwargs"]["time_ids"][0].tolist() == [64, 64, 0, 0, 64, 64]


def test_time_ids_reach_the_unet(sdxl_tiny):
    """Changing only the original size (or the crop) changes the prediction."""
    model = sdxl_tiny.model
    batch = _batch(model, n=2, precomputed=True)
    pred, _ = model.eval_forward(batch)
    bigger = {**batch, ORIGINAL_SIZE: batch[ORIGINAL_SIZE] * 4}
    assert not torch.allclose(model.eval_forward(bigger)[0], pred, atol=1e-6)
    cropped = {**batch, CROP_TOP_LEFT: batch[CROP_TOP_LEFT] + 8}
    assert not torch.allclose(model.eval_forward(cropped)[0], pred, atol=1e-6)
    torch.testing.assert_close(model.eval_forward(dict(batch))[0], pred)  # and nothing else moved


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("sdxl-tiny").model
    batch = _batch(model, n=8, precomputed=True)
    batch["latents"] = batch.pop("latent_moments")[:, :4]
    before = model.loss(model.eval_forward(batch), batch).item()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(10):
        opt.zero_grad()
        model.loss(model(batch), batch).backward()
        opt.step()
    after = model.loss(model.eval_forward(batch), batch).item()
    assert after < 0.6 * before, (before, after)


def test_wrong_width_embeddings_are_named(sdxl_tiny):
    batch = _batch(sdxl_tiny.model, n=2, precomputed=True)
    with pytest.raises(UsageError, match="'text_embeds' are 32 wide .* this UNet takes 64 and 32"):
        sdxl_tiny.model({**batch, TEXT_EMBEDS: torch.randn(2, 77, 32)})
    with pytest.raises(UsageError, match="prediction_type 'sample' is not supported"):
        build_model("sdxl-tiny", prediction_type="sample")
    assert describe("sdxl-tiny").downsample_factor == 16 and describe("sdxl-base").resolution == 1024
    from diffusion.config import TrainConfig

    StableDiffusionXL.check_config(TrainConfig(model_name="sdxl-tiny", prediction_type="v_prediction"))  # SD's rules
    with pytest.raises(UsageError, match=r"unknown SDXL objective key\(s\) \['shift'\]"):  # FLUX's, not SD's
        StableDiffusionXL.check_config(TrainConfig(model_name="sdxl-tiny", objective={"shift": 2.0}))


def _jpeg(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_the_crop_is_recorded_as_sdxl_measures_it():
    """Offsets in the image resized so its shorter side is the target size; a flip mirrors them."""
    data = _jpeg(192, 96, 0)  # 2:1, resized to 128x64 for a 64-px crop
    centre = ImageTransform(64)(data)
    assert centre.pixels.shape == (3, 64, 64) and centre.stored_size == (96, 192) and centre.crop_top_left == (0, 32)
    seen = set()
    for seed in range(40):
        c = ImageTransform(64, crop="random", hflip=True)(data, np.random.default_rng(seed))
        top, left = c.crop_top_left
        assert top == 0 and 0 <= left <= 64
        seen.add(left)
    assert len(seen) > 10
    tall = ImageTransform(32)(_jpeg(50, 100, 1))  # 1:2, resized to 32x64: centred 16 px down
    assert tall.crop_top_left == (16, 0)


def test_image_datasets_add_the_size_keys_only_for_models_that_take_them(mds_images, sdxl_tiny, sd_tiny):
    """A dataset without original_width/height columns (80x96 JPEGs) gives the stored size; SD gets no keys."""
    from diffusion.data.loaders import size_conditioning, streaming_dataset

    def first(built):
        return streaming_dataset(
            remote=None,
            local=str(mds_images),
            key="local",
            precomputed=False,
            image_size=64,
            tokenizers=built.tokenizers,
            size_conditioning=size_conditioning(built.model, 64),
        )[0]

    sample = first(sdxl_tiny)
    assert sample[ORIGINAL_SIZE].tolist() == [80, 96] and sample[CROP_TOP_LEFT].tolist() == [0, 6]  # 8 px x 64/80
    assert set(sample) == {"image", "input_ids", "input_ids_2", ORIGINAL_SIZE, CROP_TOP_LEFT}
    assert set(first(sd_tiny)) == {"image", "input_ids"}


def test_precompute_stores_the_sizes_and_training_reads_them(tmp_path):
    """data.py precompute of MDS images (with original_width/height columns, as data.py convert writes
    them) keeps the original size and crop per sample; training on the result runs."""
    from streaming import MDSWriter

    src = tmp_path / "images"
    cols = {"image": "bytes", "caption": "str", "original_width": "int", "original_height": "int"}
    with MDSWriter(out=str(src), columns=cols) as w:
        for i in range(8):
            w.write({"image": _jpeg(96, 64, i), "caption": f"cube {i}", "original_width": 960, "original_height": 640})
    out = tmp_path / "latents"
    report = precompute(str(src), str(out), model_name="sdxl-tiny", batch_size=4, num_workers=0, progress=False)
    assert report["written"] == 8
    assert report["columns"][ORIGINAL_SIZE] == "ndarray:int32:2" and report["columns"][TEXT_EMBEDS].endswith(":77,64")
    rows = read_mds(out)
    assert rows[0][ORIGINAL_SIZE].tolist() == [640, 960] and rows[0][CROP_TOP_LEFT].tolist() == [0, 16]  # 96x64->96x64
    assert rows[0][POOLED_TEXT_EMBEDS].shape == (32,)
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "sdxl-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "3ba", "--measure_skip_batches", "1", "--results", str(results)]
    assert benchmark.main(args) == 0
    line = json.loads(results.read_text().splitlines()[-1])
    assert line["family"] == "sdxl" and line["images_per_sec"] > 0


def test_export_loads_in_diffusers_samples_and_builds_again(sdxl_tiny, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    out = tmp_path / "pipe"
    sdxl_tiny.model.export(str(out), sdxl_tiny.tokenizers)
    pipe = StableDiffusionXLPipeline.from_pretrained(out, local_files_only=True)
    assert pipe.text_encoder_2.config.projection_dim == 32
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red cube", num_inference_steps=2, height=64, width=64, guidance_scale=2.0).images[0]
    assert image.size == (64, 64)

    built = build_model(str(out))  # a local SDXL pipeline directory as model_name
    assert isinstance(built.model, StableDiffusionXL) and built.resolution == 64
    for name, param in built.model.unet.named_parameters():
        torch.testing.assert_close(param, dict(sdxl_tiny.model.unet.named_parameters())[name])
    batch = _batch(built.model, n=2)
    built.model.loss(built.model(batch), batch).backward()


def test_sdxl_base_is_the_published_architecture():
    """Built on the meta device: the SDXL-base-1.0 UNet (2,567,463,684 parameters), CLIP-L and bigG towers,
    the f8 VAE; its traced training FLOPs at 1024 px."""
    with torch.device("meta"):
        model = build_model("sdxl-base").model
    count = {name: sum(p.numel() for p in getattr(model, name).parameters()) for name in model.PARTS}
    assert count == {
        "unet": 2_567_463_684,
        "vae": 83_653_863,
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
    }
    assert (
        model.vae.config.scaling_factor == 0.13025 and model.unet.config.projection_class_embeddings_input_dim == 2816
    )
    flops = model.flops_per_sample(1024)
    assert flops["denoiser"] / 1e12 == pytest.approx(20.23, rel=0.01)  # 3x the UNet's forward, ~6.74 TFLOP


def test_train_precompute_and_sample_with_a_local_second_tower(sdxl_tiny, tmp_path, mds_images):
    """text_encoder_2= and tokenizer_2= through the tools: data.py precompute encodes with them, train.py
    trains on the result with them, and generate.py samples from the checkpoint with the same tower (read
    from the run's saved config)."""
    import data
    import generate
    import train
    from diffusion.eval.trained_model import load_trained

    donor = tmp_path / "donor"
    sdxl_tiny.model.export(str(donor), sdxl_tiny.tokenizers)
    second = [f"text_encoder_2={donor / 'text_encoder_2'}", f"tokenizer_2={donor / 'tokenizer_2'}"]
    latents = tmp_path / "latents"
    cmd = ["precompute", str(mds_images), str(latents), "--model_name", "sdxl-tiny", "--image_size", "64"]
    cmd += ["--text_encoder_2", str(donor / "text_encoder_2"), "--tokenizer_2", str(donor / "tokenizer_2")]
    assert data.main([*cmd, "--batch_size", "8", "--num_workers", "0", "--progress", "lines"]) == 0
    first = read_mds(latents)[0]  # its pooled embedding is the second tower's alone
    ids = sdxl_tiny.tokenizers[INPUT_IDS_2](first["caption"], padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        pooled = sdxl_tiny.model.text_encoder_2(ids.input_ids).text_embeds[0]
    torch.testing.assert_close(torch.from_numpy(first[POOLED_TEXT_EMBEDS]).float(), pooled, atol=2e-3, rtol=2e-3)
    recipe = ["max_duration=2ba", "save_interval=2ba", "eval_interval=null", "use_ema=false", "autoresume=false"]
    run = [str(REPO / "yamls" / "sdxl-tiny-cpu.yaml"), *recipe, f"save_folder={tmp_path / 'ckpt'}", *second]
    assert train.main([*run, "use_synth_data=false", f"local={latents}", "precomputed_latents=true"]) == 0
    ckpt = str(tmp_path / "ckpt" / "latest-rank0.pt")
    built, config, _ = load_trained(ckpt)
    assert config["text_encoder_2"] == str(donor / "text_encoder_2")
    for a, b in zip(sdxl_tiny.model.text_encoder_2.parameters(), built.model.text_encoder_2.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert generate.main([ckpt, "--prompt", "a red cube", "--steps", "2", "--out", str(tmp_path / "samples")]) == 0
    assert (tmp_path / "samples" / "00000-a-red-cube.png").is_file()
