"""Krea 2 (diffusion/models/krea2.py): its caption layout (the suffix after the padding), tapped text states, latents
and transformer inputs are Krea2Pipeline's, its prediction the velocity the pipeline steps with, its timestep shift
the scheduler's line, the full-size preset's sizes and traced FLOPs against a hand count, the tiny preset through
benchmark.py (FLOPs in the results line; 2 ranks, FSDP2 + EMA, autoresume: test_family_resume.py), export (a
Turbo folder's settings kept) and sampling, the LoRA commands (benchmark.py on a pipeline folder, export.py,
diffusers' load_lora_weights, generate.py --lora), precompute, and bad input as one line."""

import json

import pytest
import torch
from conftest import (
    caption_batch,
    encoded_batch,
    first_step,
    fixed_batch_losses,
    lora_round_trip,
    read_results,
    synthetic_benchmark,
)

import benchmark
import export
import generate
from diffusion.models import build_model
from diffusion.models.krea2 import PREFIX, SUFFIX, SUFFIX_TOKENS, TEXT_LAYERS
from diffusion.models.qwen_image import DROP
from diffusion.models.rectified_flow import sample_timesteps, shift

CAPTIONS = ("a red 3", "two cats sitting on a long mat")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("krea2-tiny")


def _batch(tiny, captions=CAPTIONS):
    return caption_batch(tiny, captions)


def test_the_layout_is_the_pipelines_prefix_caption_padding_then_suffix(tiny):
    """The template's prefix and suffix, the dropped and the suffix's token counts and the default taps are
    Krea2Pipeline's; a caption's ids are its: the prefix (34 tokens, as Qwen's tokenizer cuts it), the caption, the
    padding, then the 5 suffix tokens after it."""
    pipe = tiny.model.pipeline(tiny.tokenizers)
    assert (PREFIX, SUFFIX) == (pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix)
    assert (DROP, SUFFIX_TOKENS) == (
        pipe.prompt_template_encode_start_idx,
        pipe.prompt_template_encode_num_suffix_tokens,
    )
    assert (
        TEXT_LAYERS == type(pipe)(**{**pipe.components, "text_encoder_select_layers": None}).text_encoder_select_layers
    )
    ids = _batch(tiny)["input_ids"]
    assert ids.shape == (2, DROP + 64) and len(pipe.tokenizer(PREFIX).input_ids) == DROP
    assert pipe.tokenizer.decode(ids[0, DROP : DROP + 7]) == "a red 3" and ids[0, DROP + 7] == 256  # then padding
    assert pipe.tokenizer.decode(ids[0, -SUFFIX_TOKENS:]) == SUFFIX
    one = tiny.tokenizers["input_ids"]("a red 3", max_length=DROP + 64)
    assert one.input_ids == ids[0].tolist()  # one caption, no tensors: the loader's full call


def test_text_states_and_latents_are_the_pipelines(tiny):
    """The tapped states after the prefix, side by side per token, are the pipeline's prompt embeddings where its
    mask is set (positions counting real tokens only), zeros where not, and the mask read back from them is its
    mask; the latents its VAE's posterior sample, normalised per channel (qwen_vae.py, as test_qwen_image checks)."""
    model, batch = tiny.model, _batch(tiny)
    pipe = model.pipeline(tiny.tokenizers)
    theirs, their_mask = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=model.text_length)
    ours, pooled = model.encode_text(batch)
    assert pooled is None and ours.shape == (2, 64, 6 * 32) and theirs.shape == (2, 64, 6, 32)
    torch.testing.assert_close(ours.unflatten(-1, (6, 32)), theirs * their_mask[..., None, None])
    assert model.text_mask(ours).tolist() == their_mask.tolist()
    assert their_mask.sum(dim=1).tolist() == [7 + 5, 30 + 5]  # each caption's tokens and the suffix's
    cfg = model.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1)
    z = model.vae.encode(batch["image"][:, :, None]).latent_dist.sample(torch.Generator().manual_seed(3))[:, :, 0]
    expected = (z - mean) / torch.tensor(cfg.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(model.encode_latents(batch, generator=torch.Generator().manual_seed(3)), expected)


def test_the_prediction_is_the_velocity_the_pipeline_steps_with(tiny):
    """At the pipeline's first step (sigma 1: x_t is the noise), the velocity its scheduler steps with is our
    prediction at t = 1 (the same packing, text, mask and RoPE coordinates), and the target is eps - x0 packed."""
    model, batch = tiny.model, _batch(tiny, CAPTIONS[1:])
    seq, _ = model.encode_text(batch)
    noise, x0 = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    pipe = model.pipeline(tiny.tokenizers)
    packed_noise = noise.view(1, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 16)
    velocity, _ = first_step(pipe, prompt=CAPTIONS[1], latents=packed_noise.clone(), guidance_scale=0.0,
                             num_inference_steps=2, height=64, width=64, max_sequence_length=model.text_length,
                             output_type="latent")  # fmt: skip
    with torch.no_grad():
        pred, target = model._predict(x0, noise, torch.ones(1), seq)
    torch.testing.assert_close(pred, velocity)
    x0_packed = x0.view(1, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 16)
    torch.testing.assert_close(target, packed_noise - x0_packed)


def test_a_dropped_caption_keeps_every_token_and_trains_without_nans(tiny):
    """text_dropout zeroes a caption's states: its mask then keeps every token (zeros as its text), never a text
    row with no key to attend to, which would fill the text fusion with NaNs."""
    model = tiny.model
    seq = torch.zeros(1, 64, 6 * 32)
    assert model.text_mask(seq).all()
    pred, _ = model._predict(torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), torch.tensor([0.5]), seq)
    assert torch.isfinite(pred).all()


def test_timesteps_shift_on_the_schedulers_line_by_image_size():
    """shift=auto: s = exp(mu), mu from 0.5 at 256 image tokens to 1.15 at 6400 (the scheduler's base and max image
    tokens, read from it); t uniform before the shift, or logit-normal."""
    torch.manual_seed(0)
    objective = build_model("krea2-tiny").model.objective
    assert shift(objective, 256) == pytest.approx(torch.e**0.5) and shift(objective, 6400) == pytest.approx(
        torch.e**1.15
    )
    t = sample_timesteps(objective, 20000, 256, "cpu")
    s = torch.e**0.5
    u = t / (s - (s - 1) * t)  # the shift undone
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).float().mean() - 0.1) < 0.01
    logit = build_model("krea2-tiny", objective={"timesteps": "logit_normal", "shift": 1.0}).model
    assert sample_timesteps(logit.objective, 20000, 16, "cpu").median() == pytest.approx(0.5, abs=0.02)


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    built = build_model("krea2-tiny")
    model, batch = built.model, _batch(built)
    losses = fixed_batch_losses(model, encoded_batch(model, batch))  # the encoders run once
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert all(p.grad is not None for p in model.transformer.parameters() if p.requires_grad)


def test_the_full_preset_is_the_published_size_and_its_flops_the_hand_count():
    """A 12.8B transformer (the model cards: 12.9B) and Qwen3-VL-4B (4.44B with its vision tower); the traced
    training FLOPs of the transformer at 1024 px equal a count by hand: per block and token the attention's
    projections (q, gate and out d x d, k and v d x 1536: 12 key/value heads) and the SwiGLU's three d x 16384, 2
    FLOPs a multiply-add, attention 4 S^2 d; the text fusion's blocks (5 D^2 + 3 D x 6912 a token, D = 2560) over
    12 tapped states per token (layerwise, sequences of 12) and over the caption (refiner), its projector and the
    text projection; the image embedder and the final layer; x3 for forward and backward."""
    with torch.device("meta"):
        model = build_model("krea2").model
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(12.82e9, rel=0.005)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(4.44e9, rel=0.005)
    d, kv, ff, D, fused, taps = 6144, 1536, 16384, 2560, 6912, 12
    text, image = 512, (1024 // 16) ** 2
    tokens = text + image
    fusion_token = 2 * (5 * D * D + 3 * D * fused)
    forward = (
        28 * (2 * (3 * d * d + 2 * d * kv + 3 * d * ff) * tokens + 4 * tokens**2 * d)
        + 2 * (fusion_token * text * taps + 4 * taps**2 * D * text)  # the layerwise blocks
        + 2 * (fusion_token * text + 4 * text**2 * D)  # the refiner blocks
        + 2 * taps * D * text
        + 2 * (D * d + d * d) * text  # the projector, the text projection
        + 2 * 64 * d * image * 2  # img_in and the final layer
        + 2 * 6 * d * d
        + 2 * (256 * d + d * d)  # the shared modulation, the timestep embedding
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.001)


def test_benchmark_results_line_has_traced_flops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (rec,) = synthetic_benchmark("krea2-tiny")
    assert rec["family"] == "krea2" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0


def test_export_loads_as_the_pipeline_and_a_turbo_folder_keeps_its_settings(tmp_path):
    """The export is a Krea2Pipeline folder at the run's caption length and taps; a folder recording other taps and
    is_distilled (the Turbo checkpoint) builds a model that trains on those taps and exports them again."""
    from diffusers import DiffusionPipeline

    out = tmp_path / "krea"
    assert export.main(["krea2-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "Krea2Pipeline" and pipe.tokenizer.model_max_length == 64
    assert pipe.text_encoder_select_layers == (1, 2, 3, 4, 5, 6) and not pipe.config.is_distilled
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "text_encoder_select_layers": [0, 1, 2, 4, 5, 6],
                                                       "is_distilled": True}))  # fmt: skip
    model = build_model(str(out)).model
    assert model.objective["text_layers"] == (0, 1, 2, 4, 5, 6) and model.objective["distilled"]
    assert model.objective["max_sequence_length"] == 64  # the folder keeps its caption length
    again = model.pipeline({"input_ids": pipe.tokenizer})
    assert again.text_encoder_select_layers == (0, 1, 2, 4, 5, 6) and again.config.is_distilled
    args = ["--prompt", "a red 3", "--steps", "2", "--image_size", "64", "--guidance_scale", "3"]
    assert generate.main([str(out), *args, "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()


def test_lora_on_a_pipeline_folder_exports_loads_in_diffusers_and_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pipe, gen = lora_round_trip("krea2-tiny")
    adapted = [n for n, _ in pipe.transformer.named_modules() if n.endswith(".to_gate.lora_A.lora")]
    assert len(adapted) == 2 + 2  # the 2 blocks' attention and the text fusion's 2 (layerwise, refiner)
    # the adapters on a Qwen-Image base (another family; without the record of their base): one line
    assert export.main(["qwen-image-tiny", "qwen"]) == 0
    (tmp_path / "lora" / "lora_base.json").unlink()
    capsys.readouterr()
    assert generate.main(["qwen", "--lora", "lora", *gen]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model family" in line and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_name", "krea2-tiny", "--objective", "guidance=3"], "unknown Krea 2 objective key(s)"),
        (["--model_name", "krea2-tiny", "--objective", "text_layers=1,2,3"], "num_text_layers=6 tapped states"),
        (["--model_name", "krea2-tiny", "--objective", "text_layers=1,2,3,4,5,9"], "a text encoder with 6 layers"),
        (["--model_name", "krea2-tiny", "--prediction_type", "v_prediction"], "applies to SD models"),
    ],
)
def test_a_key_of_another_family_is_one_line(argv, message, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_precompute_from_captioned_images_then_train_on_the_result(mds_images, tmp_path):
    """data.py precompute reads captioned images (laid out as the pipeline lays them out) and stores the tapped
    states side by side (padding zero, as the mask reads them) and the VAE moments; training reads them."""
    from conftest import read_mds

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="krea2-tiny", image_size=64, batch_size=8, num_workers=0, progress=False
    )
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":64,192")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (8, 8, 8)
    assert (row["text_embeds"][-SUFFIX_TOKENS - 1] == 0).all() and (row["text_embeds"][-1] != 0).any()
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "krea2-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0
