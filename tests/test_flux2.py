"""FLUX.2 [klein] (diffusion/models/flux2.py): its text states, latents and position ids are the pipeline's, its
objective (rectified flow, uniform or logit-normal t), the full-size presets' sizes and traced FLOPs against a hand
count, the tiny preset through benchmark.py (FLOPs in the results line; 2 ranks, FSDP2 + EMA, autoresume:
test_family_resume.py), export and sampling, and bad input as one line. Its LoRA export and diffusers'
load_lora_weights are test_lora.py's, its preset export test_export_presets.py's; FLUX.2 [dev] is test_flux2_dev.py's."""

import copy

import pytest
import torch
from conftest import fixed_batch_losses, read_results, routed_step_alike_under_checkpointing, synthetic_benchmark

import benchmark
import export
import generate
from diffusion.models import build_model
from diffusion.models.chat_text import qwen_length
from diffusion.models.flux2 import TEXT_LAYERS
from diffusion.models.rectified_flow import sample_timesteps


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("flux2-tiny")


def _batch(tiny, captions=("a red 3", "two cats")):
    ids = tiny.tokenizers["input_ids"](
        list(captions), padding="max_length", truncation=True, max_length=tiny.model.text_length, return_tensors="pt"
    ).input_ids
    return {"image": torch.rand(len(captions), 3, 64, 64) * 2 - 1, "input_ids": ids}


def test_text_states_and_latents_are_the_pipelines(tiny):
    """Captions go through the chat template, the stacked layers 9/18/27 with padding masked are the pipeline's
    prompt embeddings, and the latents its patchified, batch-norm-normalised VAE mode."""
    from diffusers import Flux2KleinPipeline

    model, batch = tiny.model, _batch(tiny)
    pipe = model.pipeline(tiny.tokenizers)
    assert pipe.tokenizer.decode(batch["input_ids"][0][:1]) == "<|im_start|>"
    theirs = Flux2KleinPipeline._get_qwen3_prompt_embeds(
        model.text_encoder, pipe.tokenizer, ["a red 3", "two cats"], max_sequence_length=model.text_length
    )
    ours, pooled = model.encode_text(batch)
    assert pooled is None and ours.shape == (2, 64, len(TEXT_LAYERS) * 32)
    torch.testing.assert_close(ours, theirs)
    bn = model.vae.bn
    saved = bn.running_mean.clone(), bn.running_var.clone()
    try:
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0)  # statistics a trained VAE has
        torch.testing.assert_close(model.encode_latents(batch), pipe._encode_vae_image(batch["image"], None))
    finally:
        bn.running_mean.copy_(saved[0]), bn.running_var.copy_(saved[1])


def test_the_target_is_velocity_and_the_ids_are_four_axis(tiny):
    model = tiny.model
    x0, noise, t = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4), torch.tensor([0.25, 0.75])
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        _, target = model._predict(x0, noise, t, torch.randn(2, 5, 96))
    finally:
        hook.remove()
    tt = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], ((1 - tt) * x0 + tt * noise).flatten(2).transpose(1, 2))
    torch.testing.assert_close(target, (noise - x0).flatten(2).transpose(1, 2))
    assert seen["img_ids"].shape == (2, 16, 4) and seen["img_ids"][0, 5].tolist() == [0, 1, 1, 0]
    assert seen["txt_ids"][0, :, 3].tolist() == [0, 1, 2, 3, 4] and seen["guidance"] is None


def test_routing_spans_both_stacks_each_sample_its_own_tokens(tiny):
    """Token routing across FLUX.2's double- and single-stream blocks: per sample, the span's output equals diffusers'
    own blocks (their own processors, one RoPE table) run on that sample's kept image tokens, in the joined stream
    after the double blocks; the routed tokens leave as they came, the text is the reference's too."""
    from diffusion.models.flux2 import Flux2
    from diffusion.models.per_sample_rope import PerSampleRopeFlux2, PerSampleRopeParallel
    from diffusion.techniques.routing.tokens import route_tokens

    model = copy.deepcopy(tiny.model)
    plain = copy.deepcopy(model.transformer)
    router = route_tokens(
        model.transformer, stacks=Flux2.ROUTING, share=0.5, first="double.0", last="single.0",
        attention=Flux2.ROUTING_ATTENTION,
    )  # fmt: skip
    seen = {}
    double, single = model.transformer.transformer_blocks[0], model.transformer.single_transformer_blocks[0]
    double.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), prepend=True, with_kwargs=True)
    single.register_forward_pre_hook(lambda m, a, kw: seen.update(single=kw), prepend=True, with_kwargs=True)
    single.register_forward_hook(lambda m, a, out: seen.update(out=out))
    g = torch.Generator().manual_seed(2)
    x0, noise, seq = torch.randn(3, 16, 4, 4, generator=g), torch.randn(3, 16, 4, 4, generator=g), torch.randn(3, 5, 96)
    model.train()._predict(x0, noise, torch.rand(3, generator=g), seq)
    kept, entered, out, text = router.kept, seen["hidden_states"], seen["out"], seq.shape[1]
    n, tokens = entered.shape[:2]
    assert kept.shape == (n, tokens // 2) and len({tuple(k.tolist()) for k in kept}) == n  # each sample its own
    routed = torch.ones(n, tokens, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(out[:, text:][routed], entered[routed])
    for i in range(n):
        h, e = entered[i : i + 1, kept[i]], seen["encoder_hidden_states"][i : i + 1]
        rope = tuple(torch.cat([c[:text], c[text:][kept[i]]]) for c in seen["image_rotary_emb"])
        mods = {k: seen[k][i : i + 1] for k in ("temb_mod_img", "temb_mod_txt")}
        e, h = plain.transformer_blocks[0](hidden_states=h, encoder_hidden_states=e, image_rotary_emb=rope, **mods)
        joined = plain.single_transformer_blocks[0](
            hidden_states=torch.cat([e, h], dim=1), encoder_hidden_states=None,
            temb_mod=seen["single"]["temb_mod"][i : i + 1], image_rotary_emb=rope,
        )  # fmt: skip
        torch.testing.assert_close(out[i, :text], joined[0, :text], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[i, text:][kept[i]], joined[0, text:], rtol=1e-5, atol=1e-5)
    assert isinstance(double.attn.processor, PerSampleRopeFlux2)
    assert isinstance(single.attn.processor, PerSampleRopeParallel)


def test_routing_under_gradient_checkpointing_recomputes_the_same_tokens(tiny):
    """diffusers calls FLUX.2's blocks positionally under gradient checkpointing (the single-stream ones with None for
    the text): the routed run's gradients are the same with and without it."""

    def inputs():
        return torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4), torch.rand(2), torch.randn(2, 5, 96)

    routed_step_alike_under_checkpointing(lambda: copy.deepcopy(tiny.model), "double.0", "single.1", inputs)


def test_timesteps_are_uniform_by_default_or_logit_normal_and_shifted():
    torch.manual_seed(0)
    uniform = sample_timesteps(build_model("flux2-tiny").model.objective, 20000, 16, "cpu")
    assert 0 <= uniform.min() and uniform.max() <= 1 and abs(uniform.mean() - 0.5) < 0.01
    assert abs((uniform < 0.1).float().mean() - 0.1) < 0.01
    logit = build_model("flux2-tiny", objective={"timesteps": "logit_normal", "shift": 3.0}).model
    t = sample_timesteps(logit.objective, 20000, 16, "cpu")
    assert t.median() == pytest.approx(0.75, abs=0.02)  # sigmoid(0) = 0.5 shifted: 3 * 0.5 / (1 + 2 * 0.5)


def test_loss_falls_when_training_on_a_fixed_batch(tiny):
    torch.manual_seed(0)
    built = build_model("flux2-tiny")
    model, batch = built.model, _batch(built)
    with torch.no_grad():  # the encoders run once
        batch = {"latent_moments": model.posterior_moments(batch), "text_embeds": model.encode_text(batch)[0]}
    losses = fixed_batch_losses(model, batch)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


@pytest.mark.parametrize(
    "preset, params, text_params",
    [("flux2-klein-4b", 3.88e9, 4.02e9), ("flux2-klein-9b", 9.08e9, 8.19e9), ("flux2-dev", 32.22e9, 24.01e9)],
)
def test_full_size_presets_are_the_published_sizes_and_their_flops_the_hand_count(preset, params, text_params):
    """Parameters as published (klein 4B / 9B transformers, Qwen3-4B, Qwen3-8B; dev's 32B transformer, Mistral Small
    3.1 24B with its vision tower: flux2_dev.py), and the traced training FLOPs of
    the transformer at 1024 px equal to a count by hand: every token through 13 d^2 weights per block (a double
    block's stream: attention 4 d^2, SwiGLU 9 d^2; a single block: fused 9 d^2 in, 4 d^2 out), 2 FLOPs a
    multiply-add, attention 4 S^2 d per block, the text projection, x3 for forward and backward."""
    with torch.device("meta"):
        model = build_model(preset).model
    cfg = model.transformer.config
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(params, rel=0.005)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(text_params, rel=0.005)
    d, blocks = cfg.num_attention_heads * cfg.attention_head_dim, cfg.num_layers + cfg.num_single_layers
    image, text = (1024 // 16) ** 2, 512
    tokens = image + text
    forward = (
        2 * 13 * d * d * blocks * tokens
        + 4 * tokens**2 * d * blocks
        + 2 * cfg.joint_attention_dim * d * text
        + 2 * cfg.in_channels * d * image
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.01)


def test_benchmark_results_line_has_traced_flops_with_and_without_routing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec, routed = synthetic_benchmark("flux2-tiny", ["--routing_share", "0.5"])
    assert rec["family"] == "flux2" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0
    assert routed["routing"] == {"share": 0.5, "first": "single.0", "last": "single.0"}  # 3 blocks: the middle one
    assert rec["tflop_per_image_denoiser"] > routed["tflop_per_image_denoiser"]


def test_export_loads_as_the_klein_pipeline_and_samples(tiny, tmp_path, capsys):
    from diffusers import DiffusionPipeline

    out = tmp_path / "klein"
    assert export.main(["flux2-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "Flux2KleinPipeline" and qwen_length(pipe.tokenizer) == 64
    assert build_model(str(out)).model.objective["max_sequence_length"] == 64  # the folder keeps its caption length
    assert generate.main([str(out), "--prompt", "a red 3", "--steps", "2", "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_name", "flux2-tiny", "--objective", "t5_length=3"], "unknown FLUX.2 objective key(s) ['t5_length']"),
        (["--model_name", "flux-tiny", "--objective", "pad_token_id=3"], "pad_token_id"),
        (["--model_name", "flux-tiny", "--objective", "timesteps=uniform"], "timesteps"),
        (["--model_name", "flux2-tiny", "--prediction_type", "v_prediction"], "applies to SD models"),
    ],
)
def test_a_key_of_another_family_is_one_line(argv, message, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_flux2_adapter_on_a_flux1_base_is_one_line(tmp_path, monkeypatch, capsys):
    """Also without the base's record (adapters from elsewhere): diffusers would load the double-stream attention
    layers both families name alike and drop the rest with a warning."""
    monkeypatch.chdir(tmp_path)
    assert export.main(["flux2-tiny", "klein"]) == 0 and export.main(["flux-tiny", "flux1"]) == 0
    args = ["--use_synth_data", "--model_name", "klein", "--lora_rank", "4", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*args, "--max_duration", "1ba", "--save_folder", "L", "--save_interval", "1ba"]) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0
    (tmp_path / "lora" / "lora_base.json").unlink()
    capsys.readouterr()
    assert generate.main(["flux1", "--lora", "lora", "--prompt", "a", "--steps", "1", "--out", "gen"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model family" in line and "Traceback" not in err, err


def test_precompute_from_captioned_images_then_train_on_the_result(mds_images, tmp_path):
    """data.py precompute reads captioned images (the captions through the chat template) and stores the stacked
    Qwen3 states and the VAE moments, no pooled embedding; training reads them."""
    from conftest import read_mds

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="flux2-tiny", image_size=64, batch_size=8, num_workers=0, progress=False
    )
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":64,96")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (8, 8, 8) and "pooled_text_embeds" not in row
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "flux2-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0
