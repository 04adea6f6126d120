"""diffusion/config.py: a recipe's keys, values and files are checked before anything starts (load_config), and
impossible combinations are named as the flag to change (validate); each a one-line error."""

import pytest

import train
from diffusion.config import TrainConfig, validate
from diffusion.errors import UsageError, spell


def _write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text,override,message",
    [
        ("model_name: sd-tiny\nmax_durration: 10ba\n", [], "unknown key 'max_durration'; did you mean 'max_duration'?"),
        ("batch_size: eight\n", [], "key 'batch_size': Value 'eight'"),
        ("remote: ???\n", [], "'remote' is required (left as ???)"),
        ("model_name: sd-tiny\n", ["lr"], "override 'lr' is not key=value"),
        ("model_name: sd-tiny\n", ["use_emma=true"], "command line: unknown key 'use_emma'; did you mean 'use_ema'?"),
        ("model_name: [unclosed\n", [], "not valid yaml"),
        # Composer's warmup schedulers take warmup and length in one unit (it failed at the first batch)
        ("max_duration: 64sp\nwarmup: 2ba\n", [], "warmup=2ba and max_duration=64sp must count in one unit"),
        ("max_duration: 2ep\nwarmup: 64sp\n", [], "give both in batches (ba, or epochs: ep) or both in samples"),
        ("max_duration: 64sp\nschedule: cosine\n", [], "warmup=0ba and max_duration=64sp must count in one unit"),
    ],
)
def test_bad_config_is_rejected_before_anything_starts(tmp_path, text, override, message, capsys):
    path = _write(tmp_path, text)
    assert train.main([path, *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err


@pytest.mark.parametrize(
    "max_duration,warmup,schedule", [("64sp", "8sp", "cosine"), ("4ep", "10ba", "cosine"), ("64sp", "0ba", "constant")]
)
def test_warmup_in_the_schedules_unit_passes(max_duration, warmup, schedule):
    from diffusion.config import check_settings

    check_settings(TrainConfig(max_duration=max_duration, warmup=warmup, schedule=schedule))


def test_missing_recipe_file(capsys):
    assert train.main(["yamls/no-such-recipe.yaml"]) == 2
    assert "recipe 'yamls/no-such-recipe.yaml' does not exist" in capsys.readouterr().err


def test_train_names_recipe_keys_and_other_callers_keep_the_flags(tmp_path, capsys):
    path = _write(tmp_path, "model_name: sd-tiny\nbatch_size: 4\nnum_workers: 0\n")
    assert train.main([path, f"local={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            f"train.py: error: local: no MDS dataset at '{tmp_path / 'none'}' (no index.json) and no remote given"
        )
        and "or use use_synth_data=true" in err
    ), err
    assert spell("local") == "--local" and spell("use_synth_data", "true") == "--use_synth_data"


def test_missing_checkpoint_path_is_named(tmp_path):
    with pytest.raises(UsageError, match="load_path '.*missing.pt' does not exist"):
        validate(
            TrainConfig(model_name="sd-tiny", batch_size=4, image_size=64, load_path=str(tmp_path / "missing.pt")),
            world_size=1,
            downsample_factor=16,
            on_gpu=False,
        )


@pytest.mark.parametrize(
    "batch, world, says",
    [
        (7, 2, "--batch_size 7 (the global batch) does not divide among 2 ranks (each takes batch_size / world size "
         "samples); run on 1 or 7 ranks to keep it (a resumed run then keeps its sample order), or set --batch_size 6 "
         "or --batch_size 8"),
        # a run of 2 ranks resumed on 4 (and 1 below the world size: no smaller batch that divides)
        (6, 4, "run on 3 or 6 ranks to keep it (a resumed run then keeps its sample order), or set --batch_size 4 or "
         "--batch_size 8"),
        (2, 4, "run on 2 ranks to keep it (a resumed run then keeps its sample order), or set --batch_size 4"),
    ],
)  # fmt: skip
def test_batch_not_divisible_by_world_size_says_what_to_set(batch, world, says):
    with pytest.raises(UsageError) as e:
        validate(TrainConfig(model_name="sd-tiny", batch_size=batch, image_size=64), world_size=world,
                 downsample_factor=16, on_gpu=False)  # fmt: skip
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0, -5.0])
def test_dist_timeout_must_be_positive(value):
    with pytest.raises(UsageError, match=r"^--dist_timeout .* must be a positive number of seconds"):
        validate(
            TrainConfig(model_name="sd-tiny", batch_size=4, image_size=64, dist_timeout=value),
            world_size=1,
            downsample_factor=16,
            on_gpu=False,
        )
