"""install.py: what it asks pip for, and what it refuses. pip is replaced by a recorder (no network);
the real installs run in CI, where the current set's venv is built by `install.py into-env` on a venv that
already has torch 2.11, and the command itself checks that torch stayed."""

import importlib.util
import json
import sys

import pytest
from conftest import REPO
from packaging.requirements import Requirement


@pytest.fixture
def install(monkeypatch):
    spec = importlib.util.spec_from_file_location("install_py", REPO / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.calls = []
    monkeypatch.setattr(module, "pip", lambda *args, quiet=True: module.calls.append(list(args)))
    return module


def fake_installed(monkeypatch, install, **versions):
    real = install.V.installed
    monkeypatch.setattr(install.V, "installed", lambda name: versions.get(name, real(name)))


def test_stack_requirements_never_name_torch_or_the_pinned_pair(install):
    reqs = [Requirement(r) for r in install.stack_requirements()]
    names = {r.name.lower() for r in reqs}
    assert not names & {"torch", "torchvision", "mosaicml", "mosaicml-streaming"}
    assert {"transformers", "diffusers", "huggingface-hub", "numpy", "streaming-community", "mosaicml-cli"} <= names
    assert install.no_deps_requirements() == ["mosaicml==0.32.1"]


def test_into_env_holds_torch_and_installs_composer_without_its_pins(install, monkeypatch, capsys):
    fake_installed(monkeypatch, install, torch="2.9.1+cu128", torchvision="0.24.1+cu128")
    seen = {}
    real_pip = install.pip

    def pip(*args, quiet=True):  # read the constraints file while it exists
        if "-c" in args:
            seen["held"] = open(args[args.index("-c") + 1]).read().split()
        real_pip(*args)

    monkeypatch.setattr(install, "pip", pip)
    assert install.main(["into-env", "--extras", "wandb"]) == 0
    assert seen["held"] == ["torch==2.9.1+cu128", "torchvision==0.24.1+cu128"]
    first, second, third = install.calls
    assert "wandb==0.23.1" in first and not any(a.startswith(("torch==", "torch>", "mosaicml==")) for a in first)
    assert second == ["install", "--no-deps", "mosaicml==0.32.1"]
    assert third == ["install", "--no-deps", "-e", str(REPO)]
    assert "kept torch==2.9.1+cu128, torchvision==0.24.1+cu128" in capsys.readouterr().out


def test_into_env_takes_frozen_streaming_out_before_its_fork_goes_in(install, monkeypatch):
    fake_installed(monkeypatch, install, torch="2.9.1", torchvision="0.24.1", **{"mosaicml-streaming": "0.13.0"})
    assert install.main(["into-env", "--no-project"]) == 0
    assert install.calls[0] == ["uninstall", "-y", "mosaicml-streaming"]
    assert any(r.startswith("streaming-community>=0.14.2") for r in install.calls[1])


def test_into_env_no_project_installs_only_the_dependencies(install, monkeypatch):
    fake_installed(monkeypatch, install, torch="2.9.1", torchvision="0.24.1")
    assert install.main(["into-env", "--no-project"]) == 0
    assert len(install.calls) == 2 and not any(str(REPO) in call for call in install.calls)


def test_into_env_fails_when_pip_replaced_torch(install, monkeypatch, capsys):
    state = {"torch": "2.9.1", "torchvision": "0.24.1"}
    monkeypatch.setattr(install.V, "installed", lambda name: state.get(name, "1.0"))
    monkeypatch.setattr(install, "pip", lambda *a, quiet=True: state.update(torch="2.7.0"))
    assert install.main(["into-env"]) == 2
    assert capsys.readouterr().err.strip() == (
        "install.py: error: into-env: torch==2.9.1, torchvision==0.24.1 became "
        "torch==2.7.0, torchvision==0.24.1; reinstall your torch"
    )


@pytest.mark.parametrize(
    "state, message",
    [
        ({}, "no torch in this environment"),
        ({"torch": "2.9.1"}, "torch 2.9.1 is here but torchvision is not"),
        (
            {"torch": "2.4.0", "torchvision": "0.19.0"},
            "torch 2.4.0 is older than this project supports (tested 2.6 to 2.15)",
        ),
    ],
)
def test_into_env_refuses_an_environment_it_cannot_serve(install, monkeypatch, capsys, state, message):
    monkeypatch.setattr(install.V, "installed", lambda name: state.get(name))
    assert install.main(["into-env"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and install.calls == []


def test_unknown_extra_is_named(install, monkeypatch, capsys):
    fake_installed(monkeypatch, install, torch="2.9.1", torchvision="0.24.1")
    assert install.main(["into-env", "--extras", "wandbb"]) == 2
    assert "--extras 'wandbb' is not one of dev, wandb, examples, xformers" in capsys.readouterr().err


def test_wheel_folder_filters_torch_and_cuda(install):
    assert [
        n
        for n in [
            "torch",
            "torchvision",
            "triton",
            "nvidia-cudnn-cu13",
            "nvidia_nccl_cu12",
            "cuda-bindings",
            "numpy",
            "transformers",
            "torchmetrics",
            "torch-fidelity",
        ]
        if install.is_torch_part(n)
    ] == ["torch", "torchvision", "triton", "nvidia-cudnn-cu13", "nvidia_nccl_cu12", "cuda-bindings"]
    tags = install.platforms("x86_64", "2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "linux_x86_64"


def test_offline_refuses_a_folder_for_another_python(install, tmp_path, capsys):
    assert install.main(["offline", str(tmp_path)]) == 2
    assert "has no readable manifest.json" in capsys.readouterr().err
    other = "3.9" if sys.version_info[:2] != (3, 9) else "3.8"
    (tmp_path / "manifest.json").write_text(json.dumps({"python": other, "torch": True, "no_deps": []}))
    assert install.main(["offline", str(tmp_path)]) == 2
    assert f"holds wheels for Python {other}" in capsys.readouterr().err and install.calls == []


def test_the_composer_command_is_this_packages_launcher():
    """`composer -n N script.py ...`, the README's launcher, runs diffusion/launch.py (a stop that reads as a stop):
    pyproject declares a script of that name, installed after mosaicml's, whose script it replaces."""
    from pathlib import Path

    from conftest import composer_launcher

    assert "from diffusion.launch import main" in Path(composer_launcher()).read_text()
