import pytest
import torch
from conftest import REPO
from PIL import Image

import export
import generate
import train

PIPELINES = {
    "sd-tiny": "StableDiffusionPipeline",
    "sdxl-tiny": "StableDiffusionXLPipeline",
    "flux-tiny": "FluxPipeline",
}


@pytest.fixture(scope="module", params=list(PIPELINES))
def trained(request, tmp_path_factory):
    """A 4-batch run of the tiny recipe with EMA, samples every 2 batches, and a final checkpoint."""
    tmp = tmp_path_factory.mktemp(request.param)
    recipe = REPO / f"yamls/{request.param}-cpu.yaml"
    rc = train.main(
        [
            str(recipe),
            "eval_interval=null",
            "batch_size=4",
            "max_duration=4ba",
            "autoresume=false",
            f"save_folder={tmp / 'ckpt'}",
            "save_interval=4ba",
            "sample_interval=2ba",
            "sample_prompts=[a red cube,two cats]",
            "sample_steps=2",
            f"sample_folder={tmp / 'samples'}",
        ]
    )
    assert rc == 0
    return request.param, tmp


def test_training_logs_samples(trained):
    _, tmp = trained
    for batch in ("ba2", "ba4"):
        files = sorted(p.name for p in (tmp / "samples" / batch).iterdir())
        assert files == ["00000-a-red-cube.png", "00001-two-cats.png", "grid.png"]
        assert Image.open(tmp / "samples" / batch / "00000-a-red-cube.png").size == (64, 64)


def test_export_loads_in_diffusers_with_ema_weights_and_samples(trained):
    from diffusers import DiffusionPipeline

    from diffusion.checkpointing.ema_weights import ema_in_checkpoint
    from diffusion.eval.trained_model import load_trained

    name, tmp = trained
    ckpt = tmp / "ckpt" / "latest-rank0.pt"
    assert export.main([str(ckpt), str(tmp / "exported")]) == 0
    written = [p.suffix for p in (tmp / "exported").rglob("*") if p.is_file()]  # weights as safetensors only:
    assert ".safetensors" in written and not {".bin", ".pt", ".pth", ".ckpt", ".pkl"} & set(written)  # no pickles
    pipe = DiffusionPipeline.from_pretrained(tmp / "exported", local_files_only=True)
    assert type(pipe).__name__ == PIPELINES[name]
    built, _, used_ema = load_trained(str(ckpt))
    assert used_ema
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state"]
    ema = ema_in_checkpoint(state)
    prefix = "transformer." if name == "flux-tiny" else "unet."
    denoiser = getattr(pipe, prefix[:-1])
    for pname, param in denoiser.named_parameters():
        torch.testing.assert_close(param, ema[prefix + pname])  # the averaged weights, not the live ones
    live = state["model"][prefix + next(iter(dict(denoiser.named_parameters())))]
    assert not torch.equal(live, ema[prefix + next(iter(dict(denoiser.named_parameters())))])
    out = tmp / "from-export"
    assert (
        generate.main(
            [str(tmp / "exported"), "--prompt", "a cube", "--steps", "2", "--out", str(out), "--guidance_scale", "2"]
        )
        == 0
    )
    assert (out / "00000-a-cube.png").exists() and (out / "grid.png").exists()


def test_generate_from_checkpoint_is_seeded_and_batch_independent(trained, tmp_path):
    name, tmp = trained
    ckpt = str(tmp / "ckpt" / "latest-rank0.pt")
    args = ["--prompt", "one", "--prompt", "two", "--steps", "2", "--seed", "3"]
    sampler = ["--sampler", "euler"]
    assert generate.main([ckpt, *args, *sampler, "--batch_size", "2", "--out", str(tmp_path / "a")]) == 0
    assert generate.main([ckpt, *args, *sampler, "--batch_size", "1", "--out", str(tmp_path / "b")]) == 0
    a = torch.tensor(list(Image.open(tmp_path / "a" / "00001-two.png").getdata())).float()
    b = torch.tensor(list(Image.open(tmp_path / "b" / "00001-two.png").getdata())).float()
    assert (a - b).abs().max() <= 2  # same image (up to rounding) whatever the batch size


def test_generate_bad_inputs(tmp_path, capsys):
    assert generate.main([str(tmp_path / "nope.pt"), "--prompt", "x"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    (tmp_path / "p.tsv").write_text("id\ttext\n1\thello\n")
    assert generate.main([str(tmp_path), "--prompts", str(tmp_path / "p.tsv")]) == 2
    assert "has no 'caption' column" in capsys.readouterr().err


def test_the_sampler_is_one_of_the_familys(trained, tmp_path, capsys):
    """--sampler takes the family's choices (Family.SAMPLERS): DDIM or Euler for the UNets, flow-matching Euler only
    for FLUX; another is one line and exit 2."""
    name, tmp = trained
    ckpt, args = str(tmp / "ckpt" / "latest-rank0.pt"), ["--prompt", "one", "--steps", "1"]
    if name == "flux-tiny":
        assert generate.main([ckpt, *args, "--sampler", "ddim", "--out", str(tmp_path / "a")]) == 2
        assert "a FLUX model samples with flow-matching Euler only (--sampler euler)" in capsys.readouterr().err
    else:
        assert generate.main([ckpt, *args, "--sampler", "heun", "--out", str(tmp_path / "a")]) == 2
        assert "--sampler 'heun' is not one of ddim, euler" in capsys.readouterr().err
        assert generate.main([ckpt, *args, "--sampler", "ddim", "--out", str(tmp_path / "b")]) == 0


def test_a_pipeline_of_no_family_is_one_line():
    """Sampling asks the pipeline's family how to call it; a diffusers pipeline of no family here says which are."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    from diffusion.errors import UsageError
    from diffusion.eval.sampling import sample

    unet = UNet2DModel(sample_size=8, block_out_channels=(8,), down_block_types=("DownBlock2D",),
                       up_block_types=("UpBlock2D",), norm_num_groups=4, layers_per_block=1)  # fmt: skip
    with pytest.raises(UsageError, match="a DDPMPipeline is no pipeline of a family this project trains; supported: "):
        sample(DDPMPipeline(unet=unet, scheduler=DDPMScheduler()), ["x"], steps=1)
