"""SD and SDXL's objective section (diffusion/models/ddpm_objective.py): logit-normal timesteps, min-SNR weighting
and offset noise change the training loss only; each is a recipe key and a benchmark flag, recorded in the
results line and the checkpoint's config."""

import pytest
import torch
from conftest import FAST, REPO, read_results

import benchmark
import train
from diffusion.models import build_model
from diffusion.models.ddpm_objective import loss_weights, offset_noise, sample_timesteps

RECIPE = str(REPO / "yamls/sd-tiny-cpu.yaml")
CHOICES = {"timesteps": "logit_normal", "loss_weighting": "min_snr", "snr_gamma": 2.0, "noise_offset": 0.05}


@pytest.fixture(scope="module")
def scheduler():
    return build_model("sd-tiny").model.noise_scheduler


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_the_papers_from_the_schedule(scheduler, prediction_type):
    """min(SNR, gamma) / SNR (epsilon) or / (SNR + 1) (v), SNR = abar / (1 - abar) from the scheduler's alphas."""
    from diffusers import DDPMScheduler

    sched = DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)
    timesteps = torch.tensor([0, 50, 200, 400, 700, 999])
    abar = torch.cumprod(sched.alphas.double(), 0)[timesteps]
    snr = abar / (1 - abar)
    assert snr.max() > 5 > snr.min()  # both sides of gamma are exercised
    denominator = snr if prediction_type == "epsilon" else snr + 1
    expected = torch.minimum(snr, torch.full_like(snr, 5.0)) / denominator
    objective = {"loss_weighting": "min_snr", "snr_gamma": 5.0}
    torch.testing.assert_close(loss_weights(objective, sched, timesteps).double(), expected, rtol=1e-5, atol=1e-7)
    assert loss_weights({"loss_weighting": "none"}, sched, timesteps) is None


def test_the_training_loss_is_weighted_per_sample_and_validation_is_not():
    built = build_model("sd-tiny", prediction_type="v_prediction", objective=dict(CHOICES))
    plain = build_model("sd-tiny", prediction_type="v_prediction").model
    model = built.model
    plain.load_state_dict(model.state_dict())
    batch = {"image": torch.rand(4, 3, 64, 64) * 2 - 1, "input_ids": torch.randint(0, 258, (4, 77))}
    torch.manual_seed(0)
    pred, target, weights = model(batch)
    assert weights.shape == (4,) and (weights > 0).all() and (weights < 1).all()  # v: min(SNR, 2) / (SNR + 1)
    per_sample = ((pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(model.loss((pred, target, weights), batch), (per_sample * weights).mean())
    # validation: the same timesteps, noise and plain mean whatever the objective
    with torch.no_grad():
        ours, theirs = model.eval_forward(batch), plain.eval_forward(batch)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(model.loss(ours, batch), torch.nn.functional.mse_loss(*ours))


def _histogram(t: torch.Tensor, bins: int = 10) -> torch.Tensor:
    return torch.bincount(t * bins // 1000, minlength=bins).float() / len(t)


def test_logit_normal_timesteps_gather_in_the_middle_and_uniform_stays_uniform():
    torch.manual_seed(0)
    uniform = sample_timesteps({"timesteps": "uniform"}, 1000, 20000, "cpu")
    assert uniform.min() == 0 and uniform.max() == 999
    assert (_histogram(uniform) - 0.1).abs().max() < 0.01
    logit = sample_timesteps({"timesteps": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0}, 1000, 20000, "cpu")
    assert logit.dtype == torch.long and 0 <= logit.min() and logit.max() <= 999
    h = _histogram(logit)
    # P(0.4 < sigmoid(u) < 0.6) = 0.315 for u ~ N(0, 1); below 0.1 or above 0.9: 0.028
    assert abs(h[4:6].sum() - 0.315) < 0.02 and h[0] + h[9] < 0.04
    later = sample_timesteps({"timesteps": "logit_normal", "logit_mean": 1.0, "logit_std": 1.0}, 1000, 20000, "cpu")
    assert abs(later.float().median() - 731) < 15  # sigmoid(1) * 1000: a positive mean draws noisier timesteps


def test_offset_noise_is_one_draw_per_sample_and_channel():
    torch.manual_seed(0)
    noise = torch.zeros(64, 4, 8, 8)
    assert offset_noise(noise, 0.0) is noise
    offset = offset_noise(noise, 0.5)
    assert (offset == offset[:, :, :1, :1]).all()  # constant over the image
    assert 0.4 < offset[:, :, 0, 0].std() < 0.6


def _checkpoint_config(path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)["state"]
    return state["callbacks"]["RunConfig"]["config"]


def test_a_training_run_with_the_keys_trains_and_records_them(tmp_path):
    folder, results = tmp_path / "ckpt", tmp_path / "r.jsonl"
    keys = [f"objective.{k}={v}" for k, v in CHOICES.items()]
    args = [*FAST, "batch_size=4", "max_duration=3ba", "autoresume=false", "prediction_type=v_prediction"]
    assert train.main([RECIPE, *args, *keys, f"save_folder={folder}", "save_interval=3ba", f"results={results}"]) == 0
    (rec,) = read_results(results)
    assert {k: rec["objective"][k] for k in CHOICES} == CHOICES and rec["objective"]["logit_std"] == 1.0
    assert _checkpoint_config(folder / "latest-rank0.pt")["objective"] == CHOICES
    state = torch.load(folder / "latest-rank0.pt", map_location="cpu", weights_only=False)["state"]
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("model", ["sd-tiny", "sdxl-tiny"])
def test_benchmark_flags_reach_the_model_and_the_results_line(tmp_path, model):
    out = tmp_path / "r.jsonl"
    flags = [x for k, v in CHOICES.items() for x in ("--objective", f"{k}={v}")]
    common = ["--use_synth_data", "--batch_size", "2", "--max_duration", "2ba", "--num_workers", "0"]
    assert benchmark.main(["--model_name", model, *common, *flags, "--results", str(out)]) == 0
    (rec,) = read_results(out)
    assert rec["family"] == model.removesuffix("-tiny") and {k: rec["objective"][k] for k in CHOICES} == CHOICES


def test_a_key_the_other_keys_make_a_no_op_is_one_line(capsys):
    assert train.main([RECIPE, *FAST, "max_duration=1ba", "objective.snr_gamma=3"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("train.py: error: objective.snr_gamma applies with objective.loss_weighting=min_snr")
    flags = ["--model_name", "sdxl-tiny", "--use_synth_data", "--max_duration", "1ba", "--objective", "logit_std=2"]
    assert benchmark.main(flags) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "--objective logit_std applies with --objective timesteps=logit_normal (this run has timesteps=uniform)" in err
    )
