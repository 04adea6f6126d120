"""Install the project where users already are: an environment that has its torch, or a cluster with no internet.

    python install.py into-env                        # this Python's environment keeps its torch/torchvision/CUDA
    python install.py into-env --extras wandb         # ... plus optional extras from pyproject.toml
    python install.py into-env --no-project           # ... the dependencies only (the project comes later)
    python install.py wheels wheelhouse/ --python 3.12 --no-torch      # on a connected machine: a wheel folder
    python install.py wheels wheelhouse/ --set pinned --python 3.11    # ... the pinned set, torch + CUDA included
    python install.py offline wheelhouse/             # on the cluster: install from that folder, no index

The README's `pip install -e .` installs the pinned set (torch 2.7.0). A container or site venv with torch
2.8 to 2.15 would lose its torch to that, because Composer 0.32.1 pins torch < 2.7.1. `into-env` installs
Composer without its stale pins (it runs on the newer stack: CI tests it) and everything it and this project
import, by name, with torch and torchvision held at the installed versions by a constraint: pip may not replace
them, and the command checks afterwards that it did not. Frozen Streaming (mosaicml-streaming), if there, is
uninstalled first: its maintained fork streaming-community replaces it under the same `import streaming`.

Standard library only (it runs before anything is installed); the tested ranges and package lists are
diffusion/versions.py, loaded by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))


def _versions():
    spec = importlib.util.spec_from_file_location("_diffusion_versions", os.path.join(ROOT, "diffusion", "versions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V = _versions()


class InstallError(Exception):
    pass


def pip(*args: str, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", *(["-q"] if quiet else []), *args]
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.call(cmd) != 0:
        raise InstallError("pip failed (command above); nothing of torch was changed by this command")


def extras_requirements(extras: list[str]) -> list[str]:
    """The optional-dependencies named in pyproject.toml (e.g. wandb, dev), as written there."""
    if not extras:
        return []
    import tomllib  # Python >= 3.11; extras are optional

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        table = tomllib.load(f)["project"]["optional-dependencies"]
    out = []
    for extra in extras:
        if extra not in table:
            raise InstallError(f"--extras {extra!r} is not one of {', '.join(table)} (pyproject.toml)")
        if extra == "xformers":
            raise InstallError(
                "--extras xformers: xformers wheels are built for one torch; install the xformers "
                "release made for your torch (see its README) with pip, then this command without it"
            )
        out += table[extra]
    return out


def stack_requirements() -> list[str]:
    """Everything besides torch, torchvision and Composer: the tested ranges and Composer's imports."""
    skip = set(V.TORCH_FAMILY) | set(V.NO_DEPS)
    return [V.requirement(name) for name in V.TESTED if name not in skip] + V.THEIR_IMPORTS


def no_deps_requirements() -> list[str]:
    return [f"{name}=={V.TESTED[name][0]}" for name in V.NO_DEPS]


def held_torch() -> list[str]:
    """Constraints that hold this environment's torch and torchvision where they are."""
    held = []
    for name in V.TORCH_FAMILY:
        version = V.installed(name)
        if version is None:
            if name == "torch":
                raise InstallError(
                    f"into-env: no torch in this environment ({sys.executable}); install the torch "
                    "build for your CUDA first, or use the README's `pip install -e .` (pinned set)"
                )
            raise InstallError(
                f"into-env: torch {V.installed('torch')} is here but torchvision is not; install the "
                "torchvision release made for that torch (the PyTorch install page pairs them), then retry"
            )
        if V.status(name, version) == "too old":
            low, high = V.TESTED[name]
            raise InstallError(
                f"into-env: {name} {version} is older than this project supports "
                f"(tested {low} to {high}); upgrade it, or use the pinned set"
            )
        held.append(f"{name}=={version}")
    return held


def into_env(args) -> int:
    held = held_torch()
    reqs = stack_requirements() + extras_requirements(args.extras)
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "held.txt")
        with open(constraints, "w") as f:
            f.write("\n".join(held) + "\n")
        cons = ["-c", constraints] + sum((["-c", c] for c in args.constraint), [])
        replaced = [old for old in V.REPLACED if V.installed(old) is not None]
        if replaced:  # the same `streaming` package: the fork's files must not be left to the old one's uninstall
            pip("uninstall", "-y", *replaced)
        pip("install", *cons, *reqs)
        pip("install", "--no-deps", *no_deps_requirements())
        if args.project:
            pip("install", "--no-deps", *(["-e", ROOT] if args.editable else [ROOT]))
    after = [f"{name}=={V.installed(name)}" for name in V.TORCH_FAMILY]
    if after != held:
        raise InstallError(f"into-env: {', '.join(held)} became {', '.join(after)}; reinstall your torch")
    print("\n".join(V.table()))
    print(f"installed into {sys.prefix}; kept {', '.join(held)}")
    return 0


TORCH_PARTS = ("torch", "torchvision", "triton")


def is_torch_part(name: str) -> bool:
    """torch, torchvision and the CUDA libraries that come with them as wheels."""
    name = name.lower().replace("_", "-")
    return name in TORCH_PARTS or name.startswith(("nvidia-", "cuda-"))


def platforms(machine: str, glibc: str) -> list[str]:
    """pip --platform tags a Linux machine with this glibc accepts, newest first (pip matches them exactly)."""
    major, minor = (int(p) for p in glibc.split("."))
    tags = [f"manylinux_{major}_{n}_{machine}" for n in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{machine}", f"manylinux1_{machine}", f"linux_{machine}"]


# Pure-Python packages published only as source: built here into a wheel, valid on any platform.
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]  # omegaconf's parser runtime


def wheels(args) -> int:
    out = os.path.abspath(args.dir)
    os.makedirs(out, exist_ok=True)
    target = ["--python-version", args.python, "--implementation", "cp", "--only-binary=:all:"]
    for tag in platforms(args.machine, args.glibc):
        target += ["--platform", tag]
    pip("wheel", "--no-deps", "-w", out, *SOURCE_ONLY)
    pip("wheel", "--no-deps", "-w", out, ROOT)  # the project itself
    cons = []
    if args.set == "pinned":
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            import tomllib

            reqs = tomllib.load(f)["project"]["dependencies"]
    else:
        reqs = stack_requirements() + ["torch", "torchvision"]
        cons = ["-c", os.path.join(ROOT, "install", "current.txt")]
    reqs += extras_requirements(args.extras)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--report",
            report,
            "--target",
            os.path.join(tmp, "t"),
            "--find-links",
            out,
            *target,
            *cons,
            *reqs,
        )
        with open(report) as f:
            resolved = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(f)["install"]]
    keep = [(n, v) for n, v in resolved if not (args.no_torch and is_torch_part(n))]
    keep += [(n, V.TESTED[n][0]) for n in V.NO_DEPS if n not in {m for m, _ in keep}]
    pins = [f"{n}=={v}" for n, v in keep]
    pip("download", "--no-deps", "-d", out, "--find-links", out, *target, *pins)
    with open(os.path.join(out, "requirements.txt"), "w") as f:
        f.write("\n".join(p for p in pins if p.split("==")[0] not in V.NO_DEPS) + "\n")
    manifest = {
        "set": args.set,
        "python": args.python,
        "machine": args.machine,
        "glibc": args.glibc,
        "torch": not args.no_torch,
        "no_deps": [p for p in pins if p.split("==")[0] in V.NO_DEPS],
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(
        f"wrote {len(os.listdir(out))} files, {size / 2**20:,.0f} MiB, to {out}; "
        f"on the cluster: python install.py offline {args.dir}"
    )
    return 0


def offline(args) -> int:
    src = os.path.abspath(args.dir)
    try:
        with open(os.path.join(src, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise InstallError(
            f"offline: {src} has no readable manifest.json ({e}); make the folder with "
            "`python install.py wheels DIR` on a connected machine"
        ) from None
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != python:
        raise InstallError(
            f"offline: {src} holds wheels for Python {manifest['python']}, this is {python} "
            f"({sys.executable}); make the folder with --python {python}"
        )
    local = ["--no-index", "--find-links", src]
    held = [] if manifest["torch"] else held_torch()
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "held.txt")
        with open(constraints, "w") as f:
            f.write("\n".join(held) + "\n")
        pip("install", *local, "-c", constraints, "-r", os.path.join(src, "requirements.txt"))
    pip("install", *local, "--no-deps", *manifest["no_deps"])
    projects = [n for n in os.listdir(src) if n.startswith("diffusion-") and n.endswith(".whl")]
    pip("install", *local, "--no-deps", os.path.join(src, projects[0]))
    if held and [f"{n}=={V.installed(n)}" for n in V.TORCH_FAMILY] != held:
        raise InstallError(f"offline: torch changed from {', '.join(held)}; reinstall your torch")
    print("\n".join(V.table()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="install.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("into-env", help="install into this Python's environment, keeping its torch")
    e.add_argument(
        "--extras",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="comma-separated optional-dependencies of pyproject.toml (wandb, dev, examples)",
    )
    e.add_argument(
        "--constraint",
        action="append",
        default=[],
        metavar="FILE",
        help="a pip constraints file, e.g. install/current.txt for the exact set CI tests",
    )
    e.add_argument(
        "--no-editable",
        dest="editable",
        action="store_false",
        help="install a copy of the project instead of linking this checkout",
    )
    e.add_argument(
        "--no-project",
        dest="project",
        action="store_false",
        help="only the dependencies, not this project (docker/Dockerfile's cached dependency layer)",
    )
    w = sub.add_parser("wheels", help="write a wheel folder for an offline machine")
    w.add_argument("dir")
    w.add_argument(
        "--set",
        choices=["current", "pinned"],
        default="current",
        help="current (torch 2.11, install/current.txt) or pinned (pyproject.toml, torch 2.7.0)",
    )
    w.add_argument(
        "--no-torch",
        action="store_true",
        help="leave out torch, torchvision, triton and the CUDA wheels (the target has its own torch)",
    )
    w.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the target's Python, e.g. 3.12 (default: this one)",
    )
    w.add_argument("--machine", default="x86_64", help="x86_64 (default) or aarch64")
    w.add_argument("--glibc", default="2.28", help="the target's glibc (ldd --version), default 2.28")
    w.add_argument("--extras", type=lambda s: [x for x in s.split(",") if x], default=[])
    o = sub.add_parser("offline", help="install from a wheel folder with no index")
    o.add_argument("dir")
    args = p.parse_args(argv)
    try:
        return {"into-env": into_env, "wheels": wheels, "offline": offline}[args.command](args)
    except InstallError as e:
        print(f"install.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
