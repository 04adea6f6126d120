"""SD3 / SD3.5 (diffusion/models/sd3.py): the text states as StableDiffusion3Pipeline.encode_prompt makes them,
rectified flow with SD3's shifted logit-normal timesteps and the scheduler's timestep scale, the published sizes
and a hand count of the FLOPs, the one-line refusals, a traced FLOP count in a benchmark run, and the LoRA commands
from an exported preset to generate.py. FSDP2 + EMA on two ranks resumed is test_family_resume.py's; export of the
preset and diffusers' load_lora_weights of the adapters are test_export_presets' and test_lora's."""

import copy

import pytest
import torch
from conftest import read_results, tiny_clip_vision
from torch.utils.data import default_collate

import benchmark
import export
import generate
from diffusion.batch import INPUT_IDS, INPUT_IDS_2, T5_INPUT_IDS
from diffusion.data.synthetic import SyntheticDataset
from diffusion.models import build_model
from diffusion.models.rectified_flow import sample_timesteps
from diffusion.models.sd3 import StableDiffusion3
from diffusion.sharding import outermost_blocks
from diffusion.techniques.routing.tokens import route_tokens


@pytest.fixture(scope="module")
def sd3_tiny():
    torch.manual_seed(0)
    return build_model("sd3-tiny")


def _batch(model, n, precomputed, size=64, with_index=False):
    ds = SyntheticDataset(model.batch_shapes(size, precomputed), num_samples=n, pool=n, with_index=with_index)
    return default_collate([ds[i] for i in range(n)])


def test_text_states_are_the_pipelines_and_both_batch_layouts_train(sd3_tiny):
    model, tok = sd3_tiny.model, sd3_tiny.tokenizers
    prompts = ["a red cube", "two cats on a mat"]

    def ids(key, length):
        return tok[key](
            prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).input_ids

    batch = {INPUT_IDS: ids(INPUT_IDS, 77), INPUT_IDS_2: ids(INPUT_IDS_2, 77), T5_INPUT_IDS: ids(T5_INPUT_IDS, 32)}
    seq, pooled = model.encode_text(batch)
    assert seq.shape == (2, 77 + 32, 96) and pooled.shape == (2, 64)
    theirs, _, theirs_pooled, _ = model.pipeline(tok).encode_prompt(
        prompts, prompts, prompts, device="cpu", do_classifier_free_guidance=False, max_sequence_length=32
    )
    torch.testing.assert_close(seq, theirs)
    torch.testing.assert_close(pooled, theirs_pooled)
    assert seq[:, :77, 32 + 32 :].eq(0).all() and seq[:, 77:, 32 + 32 :].ne(0).any()  # CLIPs' 64 padded to T5's 96
    for precomputed in (False, True):
        b = _batch(model, 3, precomputed)
        pred, target = model(b)
        assert pred.shape == target.shape == (3, 4, 8, 8)
        assert torch.isfinite(model.loss((pred, target), b))


def test_flow_target_timestep_scale_and_shifted_logit_normal(sd3_tiny):
    model = sd3_tiny.model
    torch.manual_seed(0)
    t = sample_timesteps(model.objective, 20000, 16, "cpu")
    assert abs(t.median().item() - 0.75) < 0.02  # u's median 0.5, shifted by 3: 3 * 0.5 / (1 + 2 * 0.5)
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    seq, pooled, tt = torch.randn(2, 109, 96), torch.randn(2, 64), torch.tensor([0.25, 0.75])
    pred, target = model._predict(x0, noise, tt, seq, pooled)
    torch.testing.assert_close(target, noise - x0)
    x_t = (1 - tt.view(-1, 1, 1, 1)) * x0 + tt.view(-1, 1, 1, 1) * noise
    with torch.no_grad():  # the scheduler's timesteps, as StableDiffusion3Pipeline passes them
        theirs = model.transformer(x_t, seq, pooled, torch.tensor([250.0, 750.0])).sample
    torch.testing.assert_close(pred.detach(), theirs)


def test_fsdp_units_are_the_joint_blocks(sd3_tiny):
    t = sd3_tiny.model.transformer
    assert outermost_blocks(t) == set(t.transformer_blocks)


@pytest.mark.parametrize(
    "preset, params, layers, width", [("sd35-medium", 2.5e9, 24, 1536), ("sd35-large", 8.1e9, 38, 2432)]
)
def test_published_sizes_and_flops_by_hand(preset, params, layers, width):
    """Parameters as published (the position-embedding table counted, as the checkpoints hold it); the traced FLOPs
    of a 1024 px training sample within 2% of a hand count: per block and stream, 12 d^2 multiply-adds a token
    (q, k, v, out: 4 d^2; MLP: 8 d^2), SD3.5 Medium's second attention 4 d^2 more on its first 13 image streams,
    attention 2 S^2 d, the last block's text stream only its k, v; x3 for forward + backward."""
    with torch.device("meta"):
        model = build_model(preset).model
    t = model.transformer
    counted = sum(p.numel() for p in t.parameters()) + t.pos_embed.pos_embed.numel()
    assert counted == pytest.approx(params, rel=0.02)
    img, txt, d = (1024 // 16) ** 2, 77 + 256, width
    s = img + txt
    dual = len(t.config.dual_attention_layers)
    macs = layers * (12 * d * d * img + 2 * s * s * d) + (layers - 1) * 12 * d * d * txt + 2 * d * d * txt
    macs += dual * (4 * d * d * img + 2 * img * img * d)
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * 2 * macs, rel=0.02)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--image_size", "72"], "--image_size 72 must be a positive multiple of 16 for sd3-tiny"),
        (["--image_size", "512"], "larger than this transformer's position embedding (pos_embed_max_size=16"),
        (["--prediction_type", "v_prediction"], "--prediction_type applies to SD models; sd3-tiny is a sd3 model"),
        (["--routing_share", "0.5", "--routing_first", "double.0"], "--routing_first double.0: sd3-tiny has no such"),
    ],
)
def test_bad_flags_for_sd3(argv, message, capsys):
    assert benchmark.main(["--model_name", "sd3-tiny", "--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_flux_objective_key_is_one_line(tmp_path, capsys):
    import train

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name: sd3-tiny\nuse_synth_data: true\nobjective:\n  guidance: 3.5\n")
    assert train.main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "unknown SD3 objective key(s) ['guidance']" in err and len(err.strip().splitlines()) == 1


def test_benchmark_counts_traced_flops_with_and_without_routing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--use_synth_data", "--model_name", "sd3-tiny", "--batch_size", "4", "--max_duration", "3ba"]
    assert benchmark.main([*argv, "--num_workers", "0", "--results", "r.jsonl"]) == 0
    assert benchmark.main([*argv, "--num_workers", "0", "--results", "r.jsonl", "--routing_share", "0.5"]) == 0
    rec, routed = read_results(tmp_path / "r.jsonl")
    assert rec["family"] == "sd3" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0
    assert routed["routing"] == {"share": 0.5, "first": "joint.1", "last": "joint.1"}  # 2 blocks: the second alone
    assert rec["tflop_per_image_denoiser"] > routed["tflop_per_image_denoiser"]


def test_routing_spans_joint_blocks_each_sample_its_own_tokens(sd3_tiny):
    """SD3's joint blocks take no RoPE (positions were added at the patch embedding): the span's output equals, per
    sample, diffusers' own blocks run on that sample's kept tokens, and the routed tokens leave it as they came."""
    t = copy.deepcopy(sd3_tiny.model.transformer)
    plain = copy.deepcopy(t)
    router = route_tokens(t, stacks=StableDiffusion3.ROUTING, share=0.5, first="joint.0", last="joint.1")
    seen = {}
    t.transformer_blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), prepend=True, with_kwargs=True)
    t.transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.update(out=out[1]))
    g, c = torch.Generator().manual_seed(2), t.config
    t.train()(
        hidden_states=torch.randn(3, c.in_channels, 8, 8, generator=g),  # 16 tokens of 2 x 2 patches
        encoder_hidden_states=torch.randn(3, 12, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(3, c.pooled_projection_dim, generator=g),
        timestep=torch.rand(3, generator=g) * 1000,
    )
    kept, entered, out = router.kept, seen["hidden_states"], seen["out"]
    n, tokens = entered.shape[:2]
    assert kept.shape == (n, tokens // 2) and len({tuple(k.tolist()) for k in kept}) == n
    routed = torch.ones(n, tokens, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(out[routed], entered[routed])
    for i in range(n):
        h, e, temb = entered[i : i + 1, kept[i]], seen["encoder_hidden_states"][i : i + 1], seen["temb"][i : i + 1]
        for block in plain.transformer_blocks:
            e, h = block(hidden_states=h, encoder_hidden_states=e, temb=temb)
        torch.testing.assert_close(out[i, kept[i]], h[0], rtol=1e-5, atol=1e-5)


def test_lora_of_an_exported_preset_exports_and_generates(tmp_path, monkeypatch):
    """The commands of docs/sd3.md: a preset written as a pipeline folder, rank-4 adapters trained on it, exported,
    and sampled by generate.py from the folder with --lora."""
    monkeypatch.chdir(tmp_path)
    assert export.main(["sd3-tiny", "DIR"]) == 0
    argv = ["--use_synth_data", "--model_name", "DIR", "--lora_rank", "4", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*argv, "--max_duration", "2ba", "--save_folder", "L", "--save_interval", "2ba"]) == 0
    assert export.main(["L/latest-rank0.pt", "OUT"]) == 0
    assert generate.main(["DIR", "--lora", "OUT", "--prompt", "a red cube", "--steps", "2", "--out", "S"]) == 0
    assert (tmp_path / "S" / "grid.png").is_file()
    # sampling gives the transformer the caption length the folder's model trained with (77 CLIP + 32 T5 tokens),
    # not StableDiffusion3Pipeline's default 256 T5 tokens (digits: 27.5% -> 50.0% read right on one checkpoint)
    from diffusion.eval.sampling import load_pipeline, sample

    pipe, seen = load_pipeline("DIR"), []
    pipe.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["encoder_hidden_states"].shape[1]), with_kwargs=True
    )
    sample(pipe, ["a red cube"], steps=1, guidance_scale=1.0, image_size=16)
    assert seen == [build_model("DIR").model.text_length + 77] == [32 + 77]


def test_repa_aligns_a_joint_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    encoder = tiny_clip_vision(tmp_path / "enc")
    argv = ["--use_synth_data", "--model_name", "sd3-tiny", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*argv, "--max_duration", "2ba", "--repa_encoder", encoder, "--results", "r.jsonl"]) == 0
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["repa"]["block"] == "joint.0" and rec["tflop_per_image_repa"] > 0  # a third of the way into 2 blocks
