"""The tested-stack table and the check every entry point runs before importing Composer."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, repo_env, run

from diffusion import versions


@pytest.mark.parametrize(
    "text, parts",
    [
        ("2.7.0", (2, 7, 0)),
        ("2.8.0a0+5228986c39.nv25.05", (2, 8, 0)),
        ("2.11.0+cu130", (2, 11, 0)),
        ("0.32.1", (0, 32, 1)),
        ("unknown", ()),
    ],
)
def test_release_reads_container_versions(text, parts):
    assert versions.release(text) == parts


def test_status_and_requirement_follow_the_table():
    assert versions.status("torch", "2.5.1") == "too old"
    assert versions.status("torch", "2.6.0") == "ok"
    assert versions.status("torch", "2.15.3+cu130") == "ok"  # "2.15" admits every 2.15.x
    assert versions.status("torch", "2.16.0") == "newer than tested"
    assert versions.status("diffusers", None) == "missing"
    assert versions.requirement("transformers") == "transformers>=5.5,<5.24"
    assert versions.requirement("mosaicml") == "mosaicml>=0.32.1,<0.32.2"


def test_this_environment_is_inside_the_tested_ranges():
    """CI runs the suite on the pinned and the current set: both must sit inside the table, so the table
    says what is tested (DIFFUSION_REQUIRE_TESTED_STACK=1 in .ci/run). Elsewhere a newer release installed by
    hand is a skip naming it, not a failure: the rest of the suite says whether it works."""
    errors, warnings = versions.problems()
    assert errors == []
    if warnings and os.environ.get("DIFFUSION_REQUIRE_TESTED_STACK") != "1":
        pytest.skip("; ".join(warnings))
    assert warnings == []


def test_newer_than_tested_warns_in_one_line_and_runs_on(monkeypatch, capsys):
    monkeypatch.delenv("DIFFUSION_NO_NEWER_WARNING", raising=False)
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "5.99.0" if name == "transformers" else real(name))
    versions.check_stack("train.py")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "train.py: warning: transformers 5.99.0 is newer than the tested range (5.5 to 5.23); "
        "it may work: report what breaks"
    ]


def _fake_dist(root, name, version):
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("script", ["benchmark.py", "train.py", "data.py", "generate.py", "export.py", "evaluate.py"])
def test_an_old_torch_is_one_line_before_any_import(tmp_path, script):
    """A torch 2.5.1 found first on the path: every entry point says so in one line, exit 2, and never
    reaches the imports (the fake has no module, so a traceback would follow any import of torch)."""
    _fake_dist(tmp_path / "site", "torch", "2.5.1")
    args = {
        "benchmark.py": ["--use_synth_data"],
        "train.py": ["yamls/sd-tiny-cpu.yaml"],
        "data.py": ["inspect", "x"],
        "generate.py": ["x", "--prompt", "a"],
        "export.py": ["x", "y"],
        "evaluate.py": ["x", "--prompts", "p.txt", "--inception", "i", "--clip", "c", "--reference_stats", "s.npz"],
    }[script]
    env = repo_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])  # the old torch comes first
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.argv = {[script] + args!r}; "
            f"import runpy; runpy.run_path({str(REPO / script)!r}, run_name='__main__')",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"{script}: error: torch 2.5.1 is older than this project supports "
        "(tested 2.6 to 2.15); install 'torch>=2.6,<2.16'"
    ]


def test_missing_package_names_both_installs(monkeypatch, capsys):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: None if name == "streaming-community" else real(name))
    with pytest.raises(SystemExit) as e:
        versions.check_stack("data.py")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("data.py: error: streaming-community is not installed (tested 0.14.2 to 0.14)")
    assert "pip install -e ." in err and "python install.py into-env" in err and "\n" not in err


def test_frozen_streaming_beside_its_fork_is_one_line(monkeypatch, capsys):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "0.13.0" if name == "mosaicml-streaming" else real(name))
    with pytest.raises(SystemExit) as e:
        versions.check_stack("train.py")
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "train.py: error: mosaicml-streaming 0.13.0 is installed, and streaming-community replaces it (both install "
        "the same package, so one overwrites the other's files); run `pip uninstall -y mosaicml-streaming`, then "
        "`pip install --force-reinstall --no-deps 'streaming-community>=0.14.2,<0.15'`"
    )


def test_table_lists_every_package():
    out = run([sys.executable, "-m", "diffusion.versions"], cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert [r.split()[0] for r in rows[1:]] == list(versions.TESTED)
    assert all(r.split()[-1] == "ok" for r in rows[1:] if r.split()[0] not in ("pyarrow", "torch-fidelity"))
