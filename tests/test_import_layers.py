"""Nothing imports upward: every project import in diffusion/ (lazy ones included, read from the source)
goes to the module's own layer or a lower one (docs/architecture.md, section 2)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [  # lowest first; a top-level module or a package of diffusion/
    {"batch", "errors"},
    {
        "settings",
        "config",
        "unpickling",
        "ema_weights",
        "file_checks",
        "versions",
        "progress",
        "object_store",
        "cli",
        "sharding",
    },
    {"models"},
    {"data", "checkpoints", "remote_checkpoints"},
    {"eval"},
    {"callbacks"},
    {"trainer"},
    {"bench", "settings_docs"},
]
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}
ALLOWED = {  # lazy, at run time only
    ("diffusion.config", "diffusion.models"),  # validate calls the family's check_config
    ("diffusion.config", "diffusion.data"),  # the filters rule asks data/filters.py, the syntax's owner
}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "diffusion":
            names = [f"diffusion.{a.name}" for a in node.names] if node.module == "diffusion" else [node.module]
            yield from ((name, node.lineno) for name in names)
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "diffusion")


def test_every_module_has_a_layer_and_nothing_imports_upward():
    upward = []
    for path in sorted((ROOT / "diffusion").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module == "diffusion":
            continue
        mine = module.split(".")[1]
        assert mine in LEVEL, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
        for target, line in imports(path):
            theirs = target.split(".")[1]
            if LEVEL[theirs] > LEVEL[mine] and (module, f"diffusion.{theirs}") not in ALLOWED:
                upward.append(f"{path.relative_to(ROOT)}:{line} {module} -> {target}")
    assert not upward, "imports upward:\n" + "\n".join(upward)
