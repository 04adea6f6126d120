import math
import re

import numpy as np
import pytest
import torch
from conftest import composer, read_results
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from torch.utils.data import default_collate

import benchmark
from diffusion.data.synthetic import SyntheticDataset
from diffusion.errors import UsageError
from diffusion.models import build_model
from diffusion.models.rectified_flow import TimestepBinnedLoss, sample_timesteps, shift
from diffusion.models.t5_text import t5_length
from diffusion.sharding import outermost_blocks


@pytest.fixture(scope="module")
def flux_tiny():
    return build_model("flux-tiny")


def _batch(model, n, precomputed, size=64, with_index=False):
    ds = SyntheticDataset(model.batch_shapes(size, precomputed), num_samples=n, pool=n, with_index=with_index)
    return default_collate([ds[i] for i in range(n)])


def test_packing_round_trip_and_position_ids():
    latents = torch.randn(2, 16, 8, 6)
    packed = FluxPipeline._pack_latents(latents, 2, 16, 8, 6)
    assert packed.shape == (2, 4 * 3, 64)  # 2x2 patches of 16 channels -> 64-wide tokens
    torch.testing.assert_close(FluxPipeline._unpack_latents(packed, 64, 48, 8), latents)
    ids = FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    assert ids.shape == (12, 3) and ids[:, 0].eq(0).all()
    assert ids[:, 1].tolist() == [r for r in range(4) for _ in range(3)] and ids[:3, 2].tolist() == [0, 1, 2]


def test_forward_shapes_online_and_precomputed(flux_tiny):
    model = flux_tiny.model
    for precomputed in (False, True):
        batch = _batch(model, 3, precomputed)
        pred, target = model(batch)
        assert pred.shape == target.shape == (3, 16, 16)  # 8x8 latents -> 16 tokens of 4x4 channels
        assert torch.isfinite(model.loss((pred, target), batch))
    assert set(flux_tiny.tokenizers) == {"input_ids", "t5_input_ids"}


def test_objective_timesteps_and_shift(flux_tiny):
    model = flux_tiny.model
    torch.manual_seed(0)
    t = sample_timesteps(model.objective, 20000, 16, "cpu")
    assert 0 < t.min() and t.max() < 1 and abs(t.median().item() - 0.5) < 0.02  # logit-normal(0, 1)
    model.objective["shift"] = "auto"
    try:
        assert shift(model.objective, 256) == pytest.approx(math.exp(0.5)) and shift(
            model.objective, 4096
        ) == pytest.approx(math.exp(1.15))
        shifted = sample_timesteps(model.objective, 20000, 4096, "cpu")
        assert shifted.median() > 0.7  # larger images: more time spent near noise
    finally:
        model.objective["shift"] = 1.0


def test_target_is_velocity_noise_minus_data(flux_tiny):
    model = flux_tiny.model
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    seq, pooled = torch.randn(2, 32, 32), torch.randn(2, 32)
    _, target = model._predict(x0, noise, torch.tensor([0.25, 0.75]), seq, pooled)
    torch.testing.assert_close(target, FluxPipeline._pack_latents(noise - x0, 2, 4, 8, 8))


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("flux-tiny").model
    batch = _batch(model, 8, precomputed=True, with_index=True)
    batch["latents"] = batch.pop("latent_moments")[:, :4]  # fixed x0, so the batch can be learned
    metric = lambda: model.loss(model.eval_forward(batch), batch).item()  # noqa: E731
    before = metric()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(100):
        opt.zero_grad()
        model.loss(model(batch), batch).backward()
        opt.step()
    after = metric()
    assert after < 0.7 * before, (before, after)


def test_validation_metric_matches_hand_computation():
    # per-sample losses 1, 3 at t=0; 5 at t=1/8; 2 at t=7/8 -> per-timestep means 2, 5, 2 -> 3
    m = TimestepBinnedLoss(8)
    m.update(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]))
    other = TimestepBinnedLoss(8)  # a second rank's share
    other.update(torch.tensor([5.0, 2.0]), torch.tensor([1, 7]))
    m.merge_state(other)
    assert m.compute().item() == pytest.approx(3.0)


def test_eval_forward_fixes_noise_and_timestep_per_sample(flux_tiny):
    model = flux_tiny.model
    batch = _batch(model, 4, precomputed=True, with_index=True)
    pred, target, bins = model.eval_forward(batch)
    assert bins.tolist() == [0, 1, 2, 3]  # sample id mod 8
    tail = {k: v[2:] for k, v in batch.items()}  # the same samples in another batch
    pred2, target2, bins2 = model.eval_forward(tail)
    torch.testing.assert_close(target2, target[2:])
    torch.testing.assert_close(pred2, pred[2:], rtol=1e-4, atol=1e-5)
    metric = model.get_metrics(is_train=False)["ValidationLoss"]
    model.update_metric(batch, (pred, target, bins), metric)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2))
    assert metric.compute().item() == pytest.approx(per_sample.mean().item(), rel=1e-5)  # one sample per bin


def test_bad_text_inputs_are_named(flux_tiny):
    model = flux_tiny.model
    ok = _batch(model, 2, precomputed=True)
    with pytest.raises(UsageError, match="'text_embeds' are 48 wide; this transformer takes joint_attention_dim=32"):
        model({**ok, "text_embeds": torch.randn(2, 32, 48)})
    with pytest.raises(UsageError, match="'pooled_text_embeds' are 7 wide"):
        model({**ok, "pooled_text_embeds": torch.randn(2, 7)})
    with pytest.raises(
        UsageError, match="40 tokens, more than this model's max_sequence_length 32; precompute them again"
    ):
        model({**ok, "text_embeds": torch.randn(2, 40, 32)})
    online = _batch(model, 2, precomputed=False)
    with pytest.raises(UsageError, match="'t5_input_ids' has 40 tokens"):
        model({**online, "t5_input_ids": torch.zeros(2, 40, dtype=torch.long)})


def test_a_folder_keeps_the_caption_length_its_run_trained_with(tmp_path, flux_tiny):
    """An exported folder records the run's T5 caption length in its tokenizer_2, and training and sampling from the
    folder take it (they took 256 before, whatever the model had learned with); a run's objective still overrides."""
    flux_tiny.model.export(str(tmp_path / "preset"), flux_tiny.tokenizers)
    assert build_model(str(tmp_path / "preset")).model.text_length == 32  # flux-tiny's own
    assert build_model(str(tmp_path / "preset"), objective={"max_sequence_length": 20}).model.text_length == 20
    longer = build_model("flux-tiny", objective={"max_sequence_length": 48})
    longer.model.export(str(tmp_path / "longer"), longer.tokenizers)
    assert longer.tokenizers["t5_input_ids"].model_max_length == 32  # the run's own tokenizer is left as it was
    folder = build_model(str(tmp_path / "longer"))
    assert folder.model.text_length == 48
    assert folder.model.batch_shapes(64, False)["t5_input_ids"][0] == (48,)
    assert t5_length(FluxPipeline.from_pretrained(str(tmp_path / "longer")).tokenizer_2) == 48  # sampling's length
    no_limit = folder.tokenizers["t5_input_ids"]
    no_limit.model_max_length = int(1e30)  # transformers' "no limit": FLUX's default
    assert t5_length(no_limit) == 256


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--image_size", "72"], "--image_size 72 must be a positive multiple of 16 for flux-tiny"),
        (["--prediction_type", "v_prediction"], "--prediction_type applies to SD models; flux-tiny is a flux model"),
    ],
)
def test_bad_flags_for_flux(argv, message, capsys):
    assert benchmark.main(["--model_name", "flux-tiny", "--use_synth_data", "--batch_size", "4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_fsdp_units_are_the_transformer_blocks(flux_tiny):
    t = flux_tiny.model.transformer
    assert outermost_blocks(t) == set(t.transformer_blocks) | set(t.single_transformer_blocks)


def test_schnell_preset_size_and_flops_match_the_published_model():
    with torch.device("meta"):
        model = build_model("flux-schnell").model
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(11.9e9, rel=0.01)
    assert model.flops_per_sample(256, online=False)["denoiser"] == pytest.approx(20.4e12, rel=0.01)


@pytest.mark.slow
def test_benchmark_fsdp_ema_two_ranks_logs_mlperf_validation_loss(tmp_path):
    proc = composer(
        2,
        "benchmark.py",
        "--use_synth_data",
        "--model_name",
        "flux-tiny",
        "--fsdp",
        "--use_ema",
        "--batch_size",
        "8",
        "--max_duration",
        "4ba",
        "--eval_interval",
        "2ba",
        "--eval_samples",
        "16",
        "--results",
        "r.jsonl",
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert len(re.findall(r"^eval at batch \d+: ValidationLoss \d", out, re.M)) >= 2  # progress=lines' eval lines
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["family"] == "flux" and rec["world_size"] == 2 and rec["fsdp"] and rec["ema"]
    assert rec["prediction_type"] == "flow" and rec["images_per_sec"] > 0


def test_benchmark_trains_and_validates_from_precomputed_shards(tmp_path, capsys):
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    cols = {
        "latent_moments": "ndarray:float16",
        "text_embeds": "ndarray:float16",
        "pooled_text_embeds": "ndarray:float16",
        "timestep_index": "int",
    }
    for split, n in (("train", 16), ("val", 16)):
        with MDSWriter(out=str(tmp_path / split), columns=cols) as w:
            for i in range(n):
                w.write(
                    {
                        "latent_moments": rng.standard_normal((8, 8, 8)).astype(np.float16),
                        "text_embeds": rng.standard_normal((32, 32)).astype(np.float16),
                        "pooled_text_embeds": rng.standard_normal(32).astype(np.float16),
                        "timestep_index": i % 8,
                    }
                )
    out = tmp_path / "r.jsonl"
    assert (
        benchmark.main(
            [
                "--model_name",
                "flux-tiny",
                "--local",
                str(tmp_path / "train"),
                "--precomputed_latents",
                "--eval_local",
                str(tmp_path / "val"),
                "--eval_interval",
                "2ba",
                "--batch_size",
                "4",
                "--max_duration",
                "4ba",
                "--num_workers",
                "0",
                "--results",
                str(out),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert len(re.findall(r"^eval at batch \d+: ValidationLoss \d", captured.out + captured.err, re.M)) == 2
    (rec,) = read_results(out)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"]
