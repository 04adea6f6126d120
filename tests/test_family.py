"""Adding a model family is one class and one registry entry (models/base.py: Family): a pixel-space
diffusion family written here, registered with a preset, trains through benchmark.py (with EMA and a results
line) and train.py (a checkpoint), exports through export.py, and its exported pipeline directory builds again as a
model, with no edit to any file outside this test."""

import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

import benchmark
import export
import train
from diffusion.batch import IMAGE
from diffusion.errors import UsageError
from diffusion.models import build_model, describe
from diffusion.models.base import Family, Geometry
from diffusion.models.build import FAMILIES
from diffusion.models.flops import count_flops
from diffusion.models.presets import PRESETS


class PixelDiffusion(Family):
    """DDPM on pixels: no VAE, no text; a UNet2DModel predicts the noise."""

    NAME, DESCRIPTION = "pixel", "a pixel-space diffusion model"
    PIPELINE = "DDPMPipeline"
    PARTS = {"unet": UNet2DModel}
    SCHEDULER = DDPMScheduler

    def __init__(self, unet: UNet2DModel, scheduler: DDPMScheduler, *, encoder_dtype=None):
        super().__init__(encoder_dtype, unet=unet)
        self.noise_scheduler = scheduler

    @staticmethod
    def geometry(configs: dict, resolution: int | None) -> Geometry:
        unet = configs["unet"]
        return Geometry(
            resolution=resolution or unet["sample_size"], downsample_factor=2 ** (len(unet["block_out_channels"]) - 1)
        )

    def batch_shapes(self, image_size: int, precomputed: bool) -> dict[str, tuple]:
        return {} if precomputed else {IMAGE: ((3, image_size, image_size), torch.float32, None)}

    def forward(self, batch: dict):
        x0 = batch[IMAGE]
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (x0.shape[0],), device=x0.device)
        return self.unet(self.noise_scheduler.add_noise(x0, noise, t), t).sample, noise

    def loss(self, outputs, batch):
        pred, noise = outputs
        return F.mse_loss(pred, noise)

    def flops_per_sample(self, image_size: int, online: bool = True) -> dict[str, float]:
        flops = count_flops(
            UNet2DModel,
            self.unet.config,
            train=True,
            args=lambda: (torch.randn(1, 3, image_size, image_size), torch.tensor([10])),
        )
        return {"denoiser": flops, "encoders": 0.0, "total": flops}

    def flops_per_batch(self, batch: dict) -> float:
        return batch[IMAGE].shape[0] * self.flops_per_sample(batch[IMAGE].shape[-1])["total"]

    def export(self, out: str, tokenizers: dict) -> None:
        DDPMPipeline(unet=self.unet, scheduler=self.noise_scheduler).save_pretrained(out)


PRESET = {
    "family": "pixel",
    "unet": {
        "sample_size": 16,
        "in_channels": 3,
        "out_channels": 3,
        "layers_per_block": 1,
        "block_out_channels": [8, 16],
        "down_block_types": ["DownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "UpBlock2D"],
        "norm_num_groups": 4,
    },
    "scheduler": {"num_train_timesteps": 100},
}


@pytest.fixture
def pixel_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, PixelDiffusion.NAME, PixelDiffusion)  # the one registry entry
    monkeypatch.setitem(PRESETS, "pixel-tiny", PRESET)  # presets are data


def test_a_new_family_trains_exports_and_loads_with_no_edit_outside_this_file(pixel_family, tmp_path):
    results = tmp_path / "r.jsonl"
    assert (
        benchmark.main(
            [
                "--model_name",
                "pixel-tiny",
                "--use_synth_data",
                "--batch_size",
                "4",
                "--num_workers",
                "0",
                "--max_duration",
                "3ba",
                "--use_ema",
                "--measure_skip_batches",
                "1",
                "--results",
                str(results),
            ]
        )
        == 0
    )
    line = json.loads(results.read_text().splitlines()[-1])
    assert line["family"] == "pixel" and line["resolution"] == 16 and line["images_per_sec"] > 0
    assert line["mfu"] is None or line["mfu"] > 0

    assert (
        train.main(
            [
                "model_name=pixel-tiny",
                "use_synth_data=true",
                "batch_size=4",
                "num_workers=0",
                "max_duration=2ba",
                "use_ema=true",
                f"save_folder={tmp_path / 'ck'}",
                "save_interval=2ba",
            ]
        )
        == 0
    )

    out = tmp_path / "exported"
    assert export.main([str(tmp_path / "ck" / "ep0-ba2-rank0.pt"), str(out)]) == 0
    assert DDPMPipeline.from_pretrained(out).unet.config.sample_size == 16
    assert describe(str(out)).family == "pixel"  # the pipeline's class names the family
    assert isinstance(build_model(str(out)).model, PixelDiffusion)


def test_a_new_family_gets_the_generic_checks(pixel_family):
    assert describe("pixel-tiny").downsample_factor == 2
    with pytest.raises(
        UsageError,
        match=r"prediction_type does not apply to pixel-tiny \(a pixel-space diffusion "
        r"model\); it takes neither",
    ):
        benchmark._main(["--model_name", "pixel-tiny", "--use_synth_data", "--prediction_type", "epsilon"])
    with pytest.raises(UsageError, match="vae: pixel-tiny is a pixel-space diffusion model, which has no parts"):
        describe("pixel-tiny", local_parts={"vae": "/nowhere"})


def test_the_model_name_help_names_every_preset():
    """The preset list in model_name's help (config.py cannot import the presets: it sits below models/) is
    written by hand; this keeps it whole."""
    from dataclasses import fields

    from diffusion.config import Model

    (help_text,) = [f.metadata["help"] for f in fields(Model) if f.name == "model_name"]
    listed = help_text.split("(", 1)[1].split(")", 1)[0].split(", ")
    assert sorted(listed) == sorted(PRESETS)


def test_each_family_keeps_its_presets_in_the_presets_module_named_as_its_own():
    """A family's presets are data beside its class: those of the family in models/<name>.py are in
    models/presets/<name>.py, and the registry holds them all with no list kept by hand."""
    import importlib
    import pkgutil

    import diffusion.models.presets as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    for name, spec in PRESETS.items():
        module = FAMILIES[spec["family"]].__module__.rsplit(".", 1)[-1]
        assert module in modules, f"{name}: no presets module {module}.py beside {module}.py's family"
        assert name in importlib.import_module(f"diffusion.models.presets.{module}").PRESETS, name
    assert {cls.__module__.rsplit(".", 1)[-1] for cls in FAMILIES.values()} == modules
