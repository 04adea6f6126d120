"""The settings reference, generated from the declaration (diffusion/config.py and each family's objective),
so docs and --help cannot drift from what the code checks.

    python -m diffusion.settings_docs          # rewrite docs/settings.md and docs/benchmark.md's flag table
    python -m diffusion.settings_docs --check  # exit 1 when either is out of date (tests/test_settings.py)

docs/benchmark.md's table lists the keys named in its opening marker (``<!-- flags: batch_size image_size ... -->``),
each row generated; docs/settings.md lists every key.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

from diffusion.cli import markdown_table
from diffusion.config import KEYS, SECTIONS
from diffusion.settings import Key, describe_keys, keys_of, markdown_rows, section_keys
from diffusion.techniques import TECHNIQUES

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("key, flag", "default", "allowed", "meaning")
_FLAG_BLOCK = re.compile(r"(<!-- flags: ([^>]*?) -->\n)(.*?)(<!-- end flags -->)", re.S)


def objective_sections() -> dict[str, type]:
    """Each objective section, by the names of the families that take it ("sd, sdxl": SDXL inherits SD's), in
    the registry's order (the model stack is imported: for docs and --help-keys)."""
    from diffusion.models.build import FAMILIES

    names: dict[type, list[str]] = {}
    for name, cls in FAMILIES.items():
        if cls.OBJECTIVE is not None:
            names.setdefault(cls.OBJECTIVE, []).append(name)
    return {", ".join(families): section for section, families in names.items()}


def objective_keys(family: str, section: type) -> list[Key]:
    return [replace(k, name=f"objective.{k.name}", section=f"objective ({family})") for k in section_keys(section)]


def _descriptions(families: str) -> list[str]:
    from diffusion.models.build import FAMILIES

    return [FAMILIES[name].DESCRIPTION for name in families.split(", ")]


def help_keys(flags: bool) -> str:
    """Every key by section with its allowed values, default and help (train.py --help-keys)."""
    keys = list(KEYS)
    for family, section in objective_sections().items():
        keys += objective_keys(family, section)
    return describe_keys(keys, flags)


def settings_markdown() -> str:
    lines = [
        "# Settings reference",
        "",
        "Generated from the declaration in `diffusion/config.py`, each training technique's section (its module in",
        "`diffusion/techniques/`) and each model family's objective section by",
        "`python -m diffusion.settings_docs`; a test fails when this file is out of date. Every key is a recipe key",
        "of `train.py` (`key: value` in a yaml, `key=value` on the command line) and a flag of `benchmark.py`",
        "(`--key value`; a switch for a key that is off by default, `--no_key` for one that is on). A value outside",
        "what a key allows stops the run before anything is built: one line naming the key, exit 2.",
        "",
        "Recipes are flat (`lr: 1.0e-4`, not `optimization: {lr: ...}`): every key is unique across sections, so the",
        "sections group the reference without changing a recipe, a checkpoint's saved config or a flag.",
    ]
    techniques = {t.SETTINGS: t for t in TECHNIQUES}
    for section in SECTIONS:
        technique = techniques.get(section)
        name = f"{technique.NAME} (technique: diffusion/techniques/{technique.NAME}.py)" if technique else None
        name = name or section.__name__.lower()
        lines += ["", f"## {name}", "", *markdown_table(HEADER, markdown_rows(keys_of(section), flags=None))]
    for family, section in objective_sections().items():
        lines += [
            "",
            f"## objective ({family})",
            "",
            f"`objective.KEY=VALUE` (`--objective KEY=VALUE`) for {' or '.join(_descriptions(family))}; its preset "
            "may set some of them.",
            "",
            *markdown_table(("key", *HEADER[1:]), markdown_rows(objective_keys(family, section), flags=False)),
        ]
    return "\n".join(lines) + "\n"


def with_flags(text: str) -> str:
    """A page (docs/benchmark.md) with its flag table regenerated for the keys its marker names."""
    by_name = {k.name: k for k in KEYS}

    def table(m: re.Match) -> str:
        keys = [by_name[name] for name in m.group(2).split()]
        rows = markdown_table(("flag", "default", "allowed", "meaning"), markdown_rows(keys, flags=True))
        return m.group(1) + "\n".join(rows) + "\n" + m.group(4)

    return _FLAG_BLOCK.sub(table, text)


def main(argv: list[str]) -> int:
    outputs = {ROOT / "docs/settings.md": settings_markdown()}
    flags = ROOT / "docs/benchmark.md"
    outputs[flags] = with_flags(flags.read_text())
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python -m diffusion.settings_docs", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
