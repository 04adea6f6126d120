"""Qwen-Image (diffusion/models/qwen_image.py): its prompt template, text states and latents are the pipeline's, its
objective (rectified flow, uniform or logit-normal t shifted by 3), the full-size preset's sizes and traced FLOPs
against a hand count, the tiny preset through benchmark.py (FLOPs in the results line; 2 ranks, FSDP2 + EMA,
autoresume: test_family_resume.py), export and sampling, the LoRA commands (benchmark.py on a pipeline folder,
export.py, diffusers' load_lora_weights, generate.py --lora), and bad input as one line."""

import copy

import pytest
import torch
from conftest import (
    caption_batch,
    encoded_batch,
    fixed_batch_losses,
    read_results,
    routed_step_alike_under_checkpointing,
    synthetic_benchmark,
)

import benchmark
import export
import generate
from diffusion.models import build_model
from diffusion.models.qwen_image import DROP, PROMPT_TEMPLATE
from diffusion.models.rectified_flow import sample_timesteps

CAPTIONS = ("a red 3", "two cats on a mat")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("qwen-image-tiny")


def _batch(tiny, captions=CAPTIONS):
    return caption_batch(tiny, captions)


def test_the_template_is_the_pipelines_and_its_prefix_the_dropped_tokens(tiny):
    """The template and the count of dropped tokens are QwenImagePipeline's; the offline tokenizer cuts the
    template's prefix into those 34 tokens, as Qwen2.5's does, so the kept states start at the caption."""
    pipe = tiny.model.pipeline(tiny.tokenizers)
    assert (PROMPT_TEMPLATE, DROP) == (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == DROP
    ids = _batch(tiny)["input_ids"][0]
    assert pipe.tokenizer.decode(ids[DROP : DROP + 7]) == "a red 3"


def test_text_states_and_latents_are_the_pipelines(tiny):
    """The kept last-layer states, padding zeroed, are the pipeline's prompt embeddings (its mask the non-zero rows);
    the latents its VAE's posterior sample, normalised by latents_mean and latents_std (QwenImageImg2ImgPipeline)."""
    from diffusers import QwenImageImg2ImgPipeline

    model, batch = tiny.model, _batch(tiny)
    pipe = model.pipeline(tiny.tokenizers)
    theirs, their_mask = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=model.text_length)
    ours, pooled = model.encode_text(batch)
    n = theirs.shape[1]
    assert pooled is None and ours.shape == (2, 32, 32) and n < 32
    torch.testing.assert_close(ours[:, :n], theirs)
    assert ours[:, n:].eq(0).all()
    torch.testing.assert_close(model.text_mask(ours)[:, :n], their_mask)
    vae = model.vae
    saved = dict(vae.config)
    try:
        vae.register_to_config(latents_mean=[0.5, -1.0, 0.1, 2.0], latents_std=[2.0, 0.5, 1.5, 3.0])
        img2img = QwenImageImg2ImgPipeline(**pipe.components)
        expected = img2img._encode_vae_image(batch["image"][:, :, None], torch.Generator().manual_seed(5))[:, :, 0]
        torch.testing.assert_close(model.encode_latents(batch, generator=torch.Generator().manual_seed(5)), expected)
    finally:
        vae.register_to_config(latents_mean=saved["latents_mean"], latents_std=saved["latents_std"])


def test_the_target_is_velocity_and_the_transformer_gets_the_pipelines_inputs(tiny):
    model = tiny.model
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.tensor([0.25, 0.75])
    seq = torch.randn(2, 5, 32)
    seq[1, 3:] = 0  # a shorter caption, zero-padded as the pipeline pads it
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        _, target = model._predict(x0, noise, t, seq)
    finally:
        hook.remove()
    tt = t.view(-1, 1, 1, 1)
    packed = ((1 - tt) * x0 + tt * noise).view(2, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 16)
    torch.testing.assert_close(seen["hidden_states"], packed)
    assert target.shape == (2, 16, 16) and seen["img_shapes"] == [[(1, 4, 4)]] * 2
    assert seen["encoder_hidden_states_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    torch.testing.assert_close(seen["timestep"], t)  # the pipeline's timestep / 1000: t itself


def test_timesteps_are_uniform_shifted_by_three_or_logit_normal():
    torch.manual_seed(0)
    t = sample_timesteps(build_model("qwen-image-tiny").model.objective, 20000, 16, "cpu")
    # u uniform, t = 3u / (1 + 2u): P(t < 0.5) = P(u < 1/4)
    assert 0 <= t.min() and t.max() <= 1 and abs((t < 0.5).float().mean() - 0.25) < 0.01
    logit = build_model("qwen-image-tiny", objective={"timesteps": "logit_normal", "shift": 1.0}).model
    assert sample_timesteps(logit.objective, 20000, 16, "cpu").median() == pytest.approx(0.5, abs=0.02)


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    built = build_model("qwen-image-tiny")
    model, batch = built.model, _batch(built)
    losses = fixed_batch_losses(model, encoded_batch(model, batch))  # the encoders run once
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    # every trainable parameter gets a gradient (the last block's unused text stream is frozen)
    assert all(p.grad is not None for p in model.transformer.parameters() if p.requires_grad)


def test_the_full_preset_is_the_published_size_and_its_flops_the_hand_count():
    """20.4B transformer and Qwen2.5-VL-7B (8.29B with its vision tower), and the traced training FLOPs of the
    transformer at 1024 px equal to a count by hand: every token through its stream's 12 d^2 weights per block
    (attention 4 d^2, a 4x GELU MLP 8 d^2), 2 FLOPs a multiply-add, attention 4 S^2 d per block, the input and output
    projections, x3 for forward and backward."""
    with torch.device("meta"):
        model = build_model("qwen-image").model
    cfg = model.transformer.config
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(20.43e9, rel=0.005)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(8.29e9, rel=0.005)
    d, blocks = cfg.num_attention_heads * cfg.attention_head_dim, cfg.num_layers
    image, text = (1024 // 16) ** 2, 512
    tokens = image + text
    forward = (
        2 * 12 * d * d * blocks * tokens
        + 4 * tokens**2 * d * blocks
        + 2 * cfg.joint_attention_dim * d * text
        + 2 * cfg.in_channels * d * image * 2  # img_in and proj_out
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.01)


def test_benchmark_results_line_has_traced_flops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec, routed = synthetic_benchmark("qwen-image-tiny", ["--routing_share", "0.5"])
    assert rec["family"] == "qwen-image" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0
    assert routed["routing"] == {"share": 0.5, "first": "joint.1", "last": "joint.1"}  # 2 blocks: the second alone
    assert rec["tflop_per_image_denoiser"] > routed["tflop_per_image_denoiser"]


def test_export_loads_as_the_pipeline_and_samples(tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "qwen"
    assert export.main(["qwen-image-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "QwenImagePipeline" and pipe.tokenizer.model_max_length == 32
    assert build_model(str(out)).model.objective["max_sequence_length"] == 32  # the folder keeps its caption length
    args = ["--prompt", "a red 3", "--steps", "2", "--image_size", "64", "--guidance_scale", "3"]
    assert generate.main([str(out), *args, "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()


def test_lora_on_a_pipeline_folder_exports_loads_in_diffusers_and_samples(tmp_path, monkeypatch, capsys):
    from diffusers import DiffusionPipeline

    monkeypatch.chdir(tmp_path)
    assert export.main(["qwen-image-tiny", "base"]) == 0
    args = ["--use_synth_data", "--model_name", "base", "--lora_rank", "4", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*args, "--max_duration", "2ba", "--save_folder", "L", "--save_interval", "1ba"]) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0
    pipe = DiffusionPipeline.from_pretrained("base", local_files_only=True)
    pipe.load_lora_weights("lora", weight_name="pytorch_lora_weights.safetensors", adapter_name="lora")
    adapted = [n for n, _ in pipe.transformer.named_modules() if n.endswith("attn.to_q.lora_A.lora")]
    assert len(adapted) == 2  # both blocks' image-stream attention (the script's to_q/k/v/to_out.0)
    gen = ["--prompt", "a red 3", "--steps", "2", "--image_size", "64", "--out", "gen"]
    assert generate.main(["base", "--lora", "lora", *gen]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()
    # the adapters on a FLUX.2 base (another family; without the record of their base): one line
    assert export.main(["flux2-tiny", "klein"]) == 0
    (tmp_path / "lora" / "lora_base.json").unlink()
    capsys.readouterr()
    assert generate.main(["klein", "--lora", "lora", *gen]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model family" in line and "Traceback" not in err, err


def test_a_local_qwen25_vl_text_encoder_replaces_the_presets_and_a_wrong_width_is_named(tiny, tmp_path):
    """text_encoder=DIR: a Qwen2.5-VL folder (its width inside text_config) replaces the preset's, frozen."""
    from diffusion.errors import UsageError
    from diffusion.models.build import describe

    model = tiny.model
    model.text_encoder.save_pretrained(tmp_path / "qwen-vl")
    swapped = build_model("qwen-image-tiny", local_parts={"text_encoder": str(tmp_path / "qwen-vl")}).model
    for a, b in zip(model.text_encoder.parameters(), swapped.text_encoder.parameters()):
        torch.testing.assert_close(a, b)
    assert not any(p.requires_grad for p in swapped.text_encoder.parameters())
    config = type(model.text_encoder.config).from_dict(model.text_encoder.config.to_dict())
    config.text_config.hidden_size = 48
    config.save_pretrained(tmp_path / "wide")
    (tmp_path / "wide" / "model.safetensors").touch()
    says = r"text_encoder: .* has text_config.hidden_size=48 but qwen-image-tiny's denoiser takes 32"
    with pytest.raises(UsageError, match=says):
        describe("qwen-image-tiny", local_parts={"text_encoder": str(tmp_path / "wide")})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_name", "qwen-image-tiny", "--objective", "guidance=3"], "unknown Qwen-Image objective key(s)"),
        (["--model_name", "qwen-image-tiny", "--objective", "max_sequence_length=2048"], "max_sequence_length"),
        (["--model_name", "qwen-image-tiny", "--prediction_type", "v_prediction"], "applies to SD models"),
        (["--model_name", "qwen-image-tiny", "--routing_share", "0.5", "--routing_first", "single.0"], "no such"),
    ],
)
def test_a_key_of_another_family_is_one_line(argv, message, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_precompute_from_captioned_images_then_train_on_the_result(mds_images, tmp_path):
    """data.py precompute reads captioned images (the captions through the prompt template) and stores the kept
    Qwen2.5-VL states (padding zero, as the mask reads them) and the VAE moments; training reads them."""
    from conftest import read_mds

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="qwen-image-tiny", image_size=64, batch_size=8, num_workers=0,
        progress=False,
    )  # fmt: skip
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":32,32")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (8, 8, 8) and "pooled_text_embeds" not in row
    assert (row["text_embeds"][-1] == 0).all()  # a short caption's padding, masked in training
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "qwen-image-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_routing_spans_joint_blocks_each_sample_its_own_tokens(tiny, zero_cond_t):
    """Token routing across Qwen-Image's dual-stream blocks: per sample, the span's output equals diffusers' own blocks
    (its own processor, the complex (image, text) RoPE tables) run on that sample's kept image tokens, the text mask
    (a padded caption) as it came, and under zero_cond_t (a reference image beside the target, its tokens modulated as
    t = 0) the kept tokens' modulate_index; the routed tokens leave the span as they came."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from diffusion.models.per_sample_rope import PerSampleRopeQwen
    from diffusion.models.qwen_image import QwenImage
    from diffusion.techniques.routing.tokens import route_tokens

    torch.manual_seed(0)
    t = QwenImageTransformer2DModel.from_config(tiny.model.transformer.config, zero_cond_t=zero_cond_t)
    plain = copy.deepcopy(t)
    router = route_tokens(
        t, stacks=QwenImage.ROUTING, share=0.5, first="joint.0", last="joint.1", attention=QwenImage.ROUTING_ATTENTION
    )
    seen = {}
    t.transformer_blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), prepend=True, with_kwargs=True)
    t.transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.update(out=out[1]))
    shapes = [(1, 4, 4), (1, 2, 2)] if zero_cond_t else [(1, 4, 4)]  # 16 image tokens (+ 4 of the reference)
    g, n = torch.Generator().manual_seed(2), 3
    mask = torch.ones(n, 6, dtype=torch.long)
    mask[1, 4:] = 0  # a shorter caption
    t.train()(
        hidden_states=torch.randn(n, sum(f * h * w for f, h, w in shapes), 16, generator=g),
        encoder_hidden_states=torch.randn(n, 6, 32, generator=g),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(n, generator=g),
        img_shapes=[shapes] * n,
    )
    kept, entered, out = router.kept, seen["hidden_states"], seen["out"]
    tokens = entered.shape[1]
    assert kept.shape == (n, tokens // 2) and len({tuple(k.tolist()) for k in kept}) == n  # each sample its own
    routed = torch.ones(n, tokens, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(out[routed], entered[routed])
    image, text = seen["image_rotary_emb"]
    for i in range(n):
        h, e = entered[i : i + 1, kept[i]], seen["encoder_hidden_states"][i : i + 1]
        temb = seen["temb"][[i, n + i] if zero_cond_t else [i]]  # zero_cond_t: the t rows, then the t = 0 rows
        index = seen["modulate_index"][i : i + 1, kept[i]] if zero_cond_t else None
        text_mask = seen["encoder_hidden_states_mask"][i : i + 1]
        for block in plain.transformer_blocks:
            e, h = block(
                hidden_states=h, encoder_hidden_states=e, encoder_hidden_states_mask=text_mask, temb=temb,
                image_rotary_emb=(image[kept[i]], text), modulate_index=index,
            )  # fmt: skip
        torch.testing.assert_close(out[i, kept[i]], h[0], rtol=1e-5, atol=1e-5)
    assert (seen["modulate_index"] is not None) == zero_cond_t
    assert all(isinstance(b.attn.processor, PerSampleRopeQwen) for b in t.transformer_blocks)
    assert type(plain.transformer_blocks[0].attn.processor) is QwenDoubleStreamAttnProcessor2_0


def test_routing_trains_with_checkpointing_and_evaluation_sends_every_token(tiny):
    """A routed training forward differs from the plain model's, but not without gradients (sampling) nor in eval mode;
    diffusers calls the blocks positionally under gradient checkpointing: the routed run's loss (finite) and gradients
    are the same with and without it."""
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.8])
    seq = torch.randn(2, 5, 32)
    seq[1, 3:] = 0  # a shorter caption, masked
    plain = copy.deepcopy(tiny.model).train()
    model, loss = routed_step_alike_under_checkpointing(
        lambda: copy.deepcopy(tiny.model), "joint.0", "joint.1", lambda: (x0, noise, t, seq)
    )
    assert torch.isfinite(loss) and loss != torch.nn.functional.mse_loss(*plain._predict(x0, noise, t, seq))
    with torch.no_grad():
        assert torch.equal(model._predict(x0, noise, t, seq)[0], plain._predict(x0, noise, t, seq)[0])
    model.eval(), plain.eval()
    assert torch.equal(model._predict(x0, noise, t, seq)[0], plain._predict(x0, noise, t, seq)[0])


def test_routed_flops_of_the_full_preset_are_the_hand_count():
    """Routing half the image tokens around blocks 1 to 58 of 60 at 1024 px: the traced training FLOPs fall by those
    blocks' image-stream work (12 d^2 weights per token) and attention (4 S^2 d) at 2048 of 4096 image tokens."""
    from diffusion.techniques.routing.tokens import install_routing

    with torch.device("meta"):
        model = build_model("qwen-image").model
    cfg = model.transformer.config
    full = model.flops_per_sample(1024, online=False)["denoiser"]
    install_routing(model, 0.5, "joint.1", "joint.58")
    d, image, text, kept = cfg.num_attention_heads * cfg.attention_head_dim, (1024 // 16) ** 2, 512, 2048
    saved = 58 * (2 * 12 * d * d * (image - kept) + 4 * ((image + text) ** 2 - (kept + text) ** 2) * d)
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(full - 3 * saved, rel=0.01)
