import os

import pytest
import torch
import yaml
from conftest import FAST, REPO

import train
from diffusion.config import load_config

RECIPES = sorted((REPO / "yamls").glob("*.yaml"))
# The fine-tuning recipes take a pipeline folder as model_name: their checks run on a preset of the family.
BASE_PRESETS = {
    f"{family}-{kind}": preset
    for family, preset in (
        ("flux", "flux-schnell"),
        ("sdxl", "sdxl-base"),
        ("sd2", "sd2-base"),
        ("flux2-klein", "flux2-klein-4b"),
        ("sd35-medium", "sd35-medium"),
        ("z-image", "z-image"),
        ("qwen-image", "qwen-image"),
        ("flux2-dev", "flux2-dev"),
        ("krea2", "krea2"),
        ("flux3", "flux3"),
        ("qwen-image-21", "qwen-image-21"),
    )
    for kind in ("lora", "finetune")
}
BASE_PRESETS["sd35-finetune"] = "sd35-large"  # Medium or Large: the larger checked


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_is_valid(recipe, tmp_path):
    from diffusion.trainer import check_before_build

    asks = yaml.safe_load(recipe.read_text())  # a dataset only where the recipe asks for one (??? ): given beside
    data = [f"{k}=s3://b/{k}" for k in ("remote", "eval_remote") if asks.get(k) == "???"]  # synthetic data, it wins
    required = [*data, f"load_path={recipe}"]  # any existing file
    if recipe.stem in BASE_PRESETS:
        required.append(f"model_name={BASE_PRESETS[recipe.stem]}")
    cfg = load_config([str(recipe)], required)
    check_before_build(cfg, world_size=8 if cfg.fsdp else 1, on_gpu=cfg.precision not in (None, "fp32"))


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    from diffusion.models.sd import StableDiffusion

    real = StableDiffusion.loss

    def poisoned(self, outputs, batch):
        loss = real(self, outputs, batch)
        return (
            loss * float("nan")
            if self.training and torch.is_grad_enabled() and poisoned.calls.__next__() >= 7
            else loss
        )

    poisoned.calls = iter(range(10**6))
    monkeypatch.setattr(StableDiffusion, "loss", poisoned)
    folder = tmp_path / "ckpt"
    rc = train.main(
        [
            str(REPO / "yamls/sd-tiny-cpu.yaml"),
            *FAST,
            "batch_size=4",
            "max_duration=20ba",
            f"save_folder={folder}",
            "save_interval=5ba",
            "autoresume=false",
        ]
    )
    assert rc == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loss is nan at batch 7" in err and "ep0-ba5-rank0.pt" in err and "is intact" in err
    state = torch.load(folder / "ep0-ba5-rank0.pt", map_location="cpu", weights_only=False)["state"]
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_load_weights_only_starts_a_fresh_run_from_trained_weights(tmp_path):
    from diffusion.trainer import build_trainer

    first = load_config(
        [str(REPO / "yamls/sd-tiny-cpu.yaml")],
        FAST
        + [
            "batch_size=4",
            "max_duration=3ba",
            f"save_folder={tmp_path / 'a'}",
            "save_interval=3ba",
            "autoresume=false",
        ],
    )
    t1 = build_trainer(first)
    t1.fit()
    weights = {k: v.clone() for k, v in t1.state.model.state_dict().items()}
    t1.close()
    second = load_config(
        [str(REPO / "yamls/sd-tiny-cpu.yaml")],
        FAST
        + [
            "batch_size=4",
            "max_duration=3ba",
            f"load_path={tmp_path / 'a' / 'ep0-ba3-rank0.pt'}",
            "load_weights_only=true",
            "save_folder=null",
            "autoresume=false",
        ],
    )
    t2 = build_trainer(second)
    assert t2.state.timestamp.batch.value == 0
    for k, v in t2.state.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    t2.close()


@pytest.mark.parametrize("omp", [None, "3"])
def test_ranks_on_one_machines_cpus_divide_its_cores(omp, monkeypatch):
    """Two ranks on one machine's CPUs take half its cores each (torch's default, a thread per core in each, ran a
    two-rank CPU batch 10x slower on 2 cores); an OMP_NUM_THREADS the user set is left alone."""

    import torch

    from diffusion.trainer import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    try:
        torch.set_num_threads(7)
        share_cpu_threads(on_gpu=False)
        cores = len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == (max(1, cores // 2) if omp is None else 7)
    finally:
        torch.set_num_threads(before)


def test_composers_environment_report_reads_the_cpu_name_without_a_subprocess(monkeypatch):
    """Composer records the CPU's name in every run and checkpoint; fast_composer_env has it read from /proc/cpuinfo
    (py-cpuinfo started a Python subprocess for it: ~1 s of every start) and from py-cpuinfo only without one."""
    import cpuinfo
    from composer.utils import collect_env, get_composer_env_dict

    from diffusion.trainer import fast_composer_env, proc_cpu_model

    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"brand_raw": "from py-cpuinfo"})
    # Composer's own (uncached here; an earlier run in this process may have replaced it already); undone after
    monkeypatch.setattr(collect_env, "get_cpu_model", lambda: str(cpuinfo.get_cpu_info().get("brand_raw", "CPU")))
    fast_composer_env()
    fast_composer_env()  # once is enough: a second call keeps the first's
    name = proc_cpu_model()
    assert name and get_composer_env_dict()["cpu_model"] == name
    monkeypatch.setattr("diffusion.trainer.proc_cpu_model", lambda: None)  # a system without /proc/cpuinfo
    assert get_composer_env_dict()["cpu_model"] == "from py-cpuinfo"
