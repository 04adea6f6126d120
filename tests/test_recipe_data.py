"""A run's training data is synthetic (use_synth_data) or an MDS dataset (remote, local), and where the recipes and
the command line disagree the later one wins, as any key does (diffusion/config.py: _synthetic_or_dataset). A
dataset named on the command line beside a recipe's use_synth_data: true lost silently to synthetic data
(issue 55); one file, or the command line, that names both is refused in one line."""

from pathlib import Path

import pytest
import yaml
from conftest import REPO

import benchmark
import train
from diffusion.config import Data, load_config

RECIPES = sorted((REPO / "yamls").glob("*.yaml"))


def _recipe(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _required(recipe: dict, but: tuple = ()) -> list[str]:
    """A value for each key the recipe leaves as ??? (but ``but``), so that it loads."""
    return [f"{k}=/given/{k}" for k, v in recipe.items() if v == "???" and k not in but]


def test_every_recipe_names_its_data_one_way():
    """Each recipe in yamls/ trains on synthetic data or names a dataset, never both (the trap is then only
    between a recipe and what overrides it, which the tests below walk)."""
    for path in RECIPES:
        recipe = _recipe(path)
        named = {"remote", "local"} & set(recipe)
        assert bool(recipe.get("use_synth_data")) != bool(named), path.name


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
@pytest.mark.parametrize("key", ["local", "remote"])
def test_a_dataset_on_the_command_line_wins_over_a_recipes_synthetic_data(path, key, tmp_path):
    recipe = _recipe(path)
    cfg = load_config([str(path)], [*_required(recipe, but=(key,)), f"{key}={tmp_path}"])
    assert cfg.use_synth_data is False and getattr(cfg, key) == str(tmp_path)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_synthetic_data_on_the_command_line_wins_over_a_recipes_dataset(path):
    recipe = _recipe(path)
    cfg = load_config([str(path)], [*_required(recipe, but=("remote", "local")), "use_synth_data=true"])
    assert cfg.use_synth_data is True and cfg.remote is None and cfg.local == Data.local


def test_a_later_recipe_file_wins_over_an_earlier_one(tmp_path):
    data = tmp_path / "data.yaml"
    data.write_text(f"local: {tmp_path}\n")
    assert load_config([str(REPO / "yamls/sd-tiny-cpu.yaml"), str(data)]).use_synth_data is False
    synthetic = tmp_path / "synthetic.yaml"
    synthetic.write_text("use_synth_data: true\n")
    assert load_config([str(data), str(synthetic)]).local == Data.local


@pytest.mark.parametrize(
    "recipe,override,says",
    [
        (
            "use_synth_data: true\nremote: s3://b/mds\n",
            [],
            "r.yaml: use_synth_data=true (synthetic data) and remote (a dataset) both name",
        ),
        (
            "model_name: sd-tiny\n",
            ["use_synth_data=true", "local=/d"],
            "command line: use_synth_data=true (synthetic data) and local (a dataset)",
        ),
        (
            "use_synth_data: true\n",
            ["local=/d", "remote=s3://b", "use_synth_data=true"],
            "and remote, local (a dataset) both name the training data; keep one",
        ),
        (
            "use_synth_data: true\nphases: [{until: 2ba, remote: s3://b/a}, {until: 4ba}]\nsave_folder: ck\nautoresume: true\n",
            [],
            "use_synth_data=true trains on synthetic data, and phases[0].remote names a dataset it would not read",
        ),
    ],
)
def test_one_place_naming_both_is_refused_in_one_line(tmp_path, recipe, override, says, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    assert train.main([str(path), *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and says in err[0], err


def test_benchmark_refuses_synthetic_data_beside_a_dataset(capsys):
    assert benchmark.main(["--use_synth_data", "--remote", "s3://b/mds", "--model_name", "sd-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "benchmark.py: error: --use_synth_data trains on synthetic data, and --remote names a dataset it would not "
        "read; drop one of them"
    )


def test_the_tiny_recipe_reads_the_dataset_given_beside_it(tmp_path, capsys):
    """The command of issue 55, run: it reads the folder it was given (here an empty one: the one-line error names
    it) instead of training on synthetic data."""
    empty = tmp_path / "mds"
    empty.mkdir()
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), f"local={empty}", "max_duration=1ba", "save_folder=null"]
    assert train.main([*args, "autoresume=false"]) == 2
    assert f"no MDS dataset at '{empty}'" in capsys.readouterr().err


def test_a_prior_beside_a_recipes_synthetic_data_is_refused(capsys):
    """prior_local is a second dataset mixed into the run's, not the run's own: it leaves the recipe's synthetic
    data in place, and synthetic data has nothing to mix it into."""
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "prior_local=/p", "max_duration=1ba", "autoresume=false"]
    assert train.main([*args, "save_folder=null"]) == 2
    assert "use_synth_data=true reads none" in capsys.readouterr().err
