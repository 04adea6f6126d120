import pytest
import torch
from composer.core import Callback
from conftest import composer
from torch.utils.data import DataLoader

from diffusion.callbacks.ema import EMA, find_ema
from diffusion.config import TrainConfig
from diffusion.data.synthetic import SyntheticDataset
from diffusion.trainer import build_trainer


def _cfg(**kw):
    base = dict(
        model_name="sd-tiny",
        use_synth_data=True,
        batch_size=4,
        max_duration="3ba",
        use_ema=True,
        ema_smoothing=0.5,
        num_workers=0,
        lr=1e-2,
    )
    return TrainConfig(**{**base, **kw})


def _ema(trainer) -> EMA:
    return find_ema(trainer.state)


def _live(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_ema_tracks_is_used_at_eval_and_survives_a_checkpoint(tmp_path):
    trainer = build_trainer(_cfg(save_folder=str(tmp_path / "ckpt"), save_interval="3ba"))
    model = trainer.state.model
    start = _live(model)
    trainer.fit()
    ema, live = _ema(trainer), _live(model)
    assert ema.num_updates == 3
    # Only the trainable denoiser is averaged, and the average sits between start and live weights.
    assert set(ema.ema) == set(live) and all(n.startswith("unet.") for n in ema.ema)
    diff = max((ema.ema[n] - live[n]).abs().max().item() for n in live)
    assert diff > 1e-4, "EMA weights equal the live weights after training steps"
    n0 = next(iter(live))
    assert not torch.equal(ema.ema[n0], start[n0])
    averaged = {n: t.clone() for n, t in ema.ema.items()}

    # At eval the model holds the EMA weights; afterwards the live weights are back.
    seen = {}

    class Probe(Callback):
        def eval_batch_start(self, state, logger):
            seen.update(_live(state.model))

    trainer.state.callbacks.append(Probe())
    shapes = model.batch_shapes(64, precomputed=False)
    trainer.eval(eval_dataloader=DataLoader(SyntheticDataset(shapes, num_samples=4), batch_size=2))
    for n in live:
        torch.testing.assert_close(seen[n], averaged[n])
        torch.testing.assert_close(model.state_dict()[n], live[n])
    metrics = trainer.state.eval_metrics["eval"]["ValidationLoss"].compute()
    assert torch.isfinite(metrics)
    trainer.close()

    # A new run loading the checkpoint gets the same average and the same live weights.
    resumed = build_trainer(_cfg(load_path=str(tmp_path / "ckpt" / "latest-rank0.pt"), max_duration="3ba"))
    ema2 = _ema(resumed)
    assert ema2.num_updates == 3
    for n in live:
        torch.testing.assert_close(ema2.ema[n], averaged[n])
        torch.testing.assert_close(resumed.state.model.state_dict()[n], live[n])
    resumed.close()


def test_ema_update_is_a_fused_lerp_in_fp32():
    lin = torch.nn.Linear(3, 2)
    ema = EMA(smoothing=0.9, update_interval=2)
    ema._model = lin
    before = {n: t.clone() for n, t in ema._ensure().items()}
    with torch.no_grad():
        lin.weight.add_(1.0)
    ema.update()
    w = 1 - 0.9**2  # two batches' worth of decay per update
    torch.testing.assert_close(ema.ema["weight"], before["weight"] * (1 - w) + lin.weight * w)
    assert ema.ema["weight"].dtype == torch.float32


@pytest.mark.slow
def test_ema_under_fsdp2_matches_hand_computation(tmp_path):
    proc = composer(2, "tests/ema_fsdp_worker.py", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EMA-FSDP-OK" in proc.stdout + proc.stderr
    resumed = [line for line in proc.stderr.splitlines() if line.startswith("autoresume: resuming from")]
    assert len(resumed) == 1 and resumed[0].startswith(  # rank 0 only, naming the sharded folder
        f"autoresume: resuming from {tmp_path / 'ckpt'}/ep0-ba3 (batch 3 of 3, saved "
    ), proc.stderr[-3000:]
    # export's reading of that sharded folder takes only the model's tensors and the EMA's, straight into the
    # rebuilt model: the same weights as converting the whole folder (optimizer state included) to one file
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from diffusion.checkpointing.ema_weights import ema_in_checkpoint
    from diffusion.eval.trained_model import load_trained

    folder = str(tmp_path / "ckpt" / "ep0-ba3")
    dcp_to_torch_save(folder, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)["state"]
    averaged = ema_in_checkpoint(whole)
    for use_ema in (True, False):
        built, _, applied = load_trained(folder, use_ema=use_ema)
        assert applied == use_ema
        for name, value in built.model.state_dict().items():
            expected = averaged[name] if use_ema and name in averaged else whole["model"][name]
            assert torch.equal(value, expected), (use_ema, name)
