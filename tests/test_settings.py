"""diffusion/settings.py + config.py: every setting is declared once, and flags, --help-keys, the docs and the
checks come from that declaration. The walking tests give every declared key (a run's and each family's
objective's) values outside its rule, through both entry points, so a key added later is covered too."""

import pytest

import benchmark
import data
import evaluate
import generate
import train
from diffusion.cli import run
from diffusion.config import KEYS
from diffusion.settings import OneOf, Range
from diffusion.settings_docs import main as settings_docs
from diffusion.settings_docs import objective_keys, objective_sections

RECIPE = "yamls/sd-tiny-cpu.yaml"
# Were a bad value let through, the run would be short and write nothing (the walked key comes after these).
SHORT = ["max_duration=1ba", "eval_interval=null", "autoresume=false", "save_folder=null"]
FLAGS = ["--model_name", "sd-tiny", "--use_synth_data", "--batch_size", "2", "--max_duration", "1ba"]


def _bad_values(key) -> list[str]:
    """Values a user might type that the key must refuse: its rule's, and one of the wrong type."""
    wrong_type = {int: ["eight"], float: ["ten"], bool: ["maybe"]}.get(key.kind, [])
    return (key.rule.bad_values() if key.rule else []) + wrong_type


def _one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_every_key_has_help_and_a_rule_or_a_plain_kind():
    for key in KEYS:
        assert key.help, f"{key.name} has no help"
        assert key.rule is not None or key.kind in (bool, dict, list), f"{key.name} declares no rule"
        assert _bad_values(key) or key.kind in (dict, list), f"{key.name}: nothing it refuses"


WALK = [(key, bad) for key in KEYS for bad in _bad_values(key)]


@pytest.mark.parametrize("key,bad", WALK, ids=[f"{k.name}={b}" for k, b in WALK])
def test_train_refuses_a_value_outside_the_rule(key, bad, capsys):
    assert train.main([RECIPE, *SHORT, f"{key.name}={bad or repr('')}"]) == 2  # key= alone is yaml's null: unset
    line = _one_error_line(capsys, "train.py")
    assert key.name in line and f"--{key.flag}" not in line, line


FLAG_WALK = [(key, bad) for key, bad in WALK if key.kind is not bool and not key.recipe_only]


@pytest.mark.parametrize("key,bad", FLAG_WALK, ids=[f"--{k.flag} {b}" for k, b in FLAG_WALK])
def test_benchmark_refuses_a_value_outside_the_rule(key, bad, capsys):
    values = [f"--{key.flag}={bad}"] if key.kind is not tuple else [f"--{key.flag}", *[bad] * len(key.default)]
    assert benchmark.main([*FLAGS, *values]) == 2
    assert f"--{key.flag}" in _one_error_line(capsys, "benchmark.py")


def data_py(argv) -> int:
    return run("data.py", data.main, argv)  # as data.py's __main__ calls it


# The tools that share some of a run's settings take them as flags declared in the same place (some without
# the section's prefix: generate.py's --steps is sample_steps); a bad value stops them the same way, before any
# file is read. Each: its name, its main, the arguments it needs besides the walked flag, its keys, the prefix.
TOOLS = [
    ("generate.py", generate.main, ["ckpt", "--prompt", "a"], generate.SAMPLING_KEYS, "sample_"),
    (
        "evaluate.py",
        evaluate.main,
        ["ckpt", "--prompts", "p", "--inception", "i", "--clip", "c", "--reference_stats", "s"],
        evaluate.QUALITY_KEYS,
        "quality_",
    ),
    ("data.py", data_py, ["precompute", "src", "out", "--model_name", "sd-tiny"], data.PRECOMPUTE_KEYS, ""),
    ("data.py", data_py, ["bench", "src"], data.BENCH_KEYS, ""),
]
TOOL_WALK = [
    (tool, main, args, f"--{key.flag.removeprefix(strip)}", bad)
    for tool, main, args, keys, strip in TOOLS
    for key in keys
    if key.kind is not bool
    for bad in _bad_values(key)
]


@pytest.mark.parametrize("tool,main,args,flag,bad", TOOL_WALK, ids=[f"{t[0]} {t[3]} {t[4]}" for t in TOOL_WALK])
def test_tools_refuse_a_shared_value_outside_the_rule(tool, main, args, flag, bad, capsys):
    assert main([*args, f"{flag}={bad}"]) == 2
    assert flag in _one_error_line(capsys, tool)


def _objective_walk():
    """Every family that takes a section walks it (SD's section is SDXL's too)."""
    models = {
        "sd": "sd-tiny",
        "sdxl": "sdxl-tiny",
        "flux": "flux-tiny",
        "vae": "vae-tiny",
        "flux2": "flux2-tiny",
        "sd3": "sd3-tiny",
        "qwen-image": "qwen-image-tiny",
        "z-image": "z-image-tiny",
        "flux2-dev": "flux2-dev-tiny",
        "krea2": "krea2-tiny",
        "flux3": "flux3-tiny",
        "flux3-distilled": "flux3-distilled-tiny",
        "qwen-image-21": "qwen-image-21-tiny",
    }
    return [
        (models[family], key, bad)
        for families, section in objective_sections().items()
        for family in families.split(", ")
        for key in objective_keys(families, section)
        for bad in _bad_values(key)
    ]


OBJECTIVE_WALK = _objective_walk()


@pytest.mark.parametrize("model,key,bad", OBJECTIVE_WALK, ids=[f"{m}:{k.name}={b}" for m, k, b in OBJECTIVE_WALK])
def test_objective_values_outside_the_rule_stop_before_the_model_is_built(model, key, bad, capsys):
    assert train.main([RECIPE, *SHORT, f"model_name={model}", f"{key.name}={bad}"]) == 2
    assert key.name in _one_error_line(capsys, "train.py")
    short = key.name.removeprefix("objective.")
    assert benchmark.main([*FLAGS, "--model_name", model, "--objective", f"{short}={bad}"]) == 2
    assert f"--objective {short}=" in _one_error_line(capsys, "benchmark.py")


def test_messages_say_what_is_allowed(capsys):
    assert train.main([RECIPE, "max_duration=10 ba s"]) == 2
    assert "max_duration='10 ba s' is not a training time: a whole number followed by ba" in _one_error_line(
        capsys, "train.py"
    )
    assert benchmark.main([*FLAGS, "--lr=-1e-4"]) == 2
    assert "--lr -0.0001 must be a positive number (learning rate" in _one_error_line(capsys, "benchmark.py")
    assert benchmark.main([*FLAGS, "--eval_interval", "0ba"]) == 2
    assert "--eval_interval '0ba' is not a training time" in _one_error_line(capsys, "benchmark.py")


NEVER_KEYS = [key for key in KEYS if key.default_text() == "never"]


@pytest.mark.parametrize("key", NEVER_KEYS, ids=[k.name for k in NEVER_KEYS])
def test_a_key_whose_default_reads_never_takes_never(key):
    """--help-keys and docs/settings.md show "default never": the word is what the key then takes, as a recipe key
    and as a flag, and it means the default (off). It was refused (issue 55)."""
    from diffusion.config import load_config

    assert NEVER_KEYS and key.rule.complaint("never") is None and key.allowed().endswith("; or never")
    cfg = load_config([RECIPE], [f"{key.name}=never"])
    assert getattr(cfg, key.name) is None
    assert benchmark.parse_args([*FLAGS, f"--{key.flag}", "never"])[key.name] is None


def test_never_is_no_word_for_an_interval_that_cannot_be_off(capsys):
    assert train.main([RECIPE, *SHORT, "save_interval=never"]) == 2
    assert "save_interval='never' is not a training time" in _one_error_line(capsys, "train.py")


def test_rules_describe_themselves():
    assert Range(gt=0, lt=1).allowed() == "in (0, 1)" and Range(ge=0, integer=True).allowed() == ">= 0"
    assert Range(gt=0, unit="seconds").allowed() == "a positive number of seconds"
    assert OneOf(("a", "b")).complaint("c") == "is not one of a, b" and OneOf(("a", "b")).complaint("a") is None


def test_help_keys_lists_every_key_by_section(capsys):
    assert train.main(["--help-keys"]) == 0
    out = capsys.readouterr().out
    for key in KEYS:
        assert f"\n  {key.name}  (" in out, key.name
    assert "objective (flux):" in out and "objective.shift  (a positive number or 'auto'" in out
    assert "objective (sd, sdxl):" in out and "objective.timesteps  (one of uniform, logit_normal" in out


def test_docs_and_readme_table_are_generated_from_the_declaration():
    assert settings_docs(["--check"]) == 0, "run python -m diffusion.settings_docs"


def test_benchmark_help_lists_every_flag_by_section(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(f"--{k.flag}" in out or f"--no_{k.name}" in out for k in KEYS if not k.recipe_only)
    assert "\noptimization:\n" in out and "\nparallelism:\n" in out


def test_streaming_cache_and_download_settings_reach_the_dataset(mds_images, sd_tiny, tmp_path):
    from diffusion.config import TrainConfig
    from diffusion.data import DataSettings, build_train_dataloader

    cfg = TrainConfig(
        model_name="sd-tiny",
        remote=str(mds_images),
        local=str(tmp_path / "cache"),
        image_size=64,
        num_workers=0,
        cache_limit="64mb",
        predownload=4,
        download_timeout=12.5,
        download_retry=3,
    )
    dataset = build_train_dataloader(DataSettings.of(cfg), sd_tiny.model, sd_tiny.tokenizers, 2).dataloader.dataset
    stream = dataset.streams[0]
    assert (dataset.cache_limit, dataset.predownload, stream.download_timeout, stream.download_retry) == (
        64 * 2**20,
        4,
        12.5,
        3,
    )
