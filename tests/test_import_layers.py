"""Nothing imports upward, and no module imports one that imports it back: every project import in diffusion/
(lazy ones inside functions included, read from the source) goes to the module's own layer or a lower one
(docs/architecture.md, section 2), and the graph of modules has no circle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import repo_env

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [  # lowest first; a top-level module or a package of diffusion/
    {"batch", "errors", "filter_syntax", "aspects"},
    {"settings", "file_checks", "versions", "progress", "object_store", "sharding", "recipe_files", "launch"},
    {"models", "checkpointing"},  # checkpointing/: folder -> remote -> local (the circles test holds the order)
    {"techniques"},  # a package each where more than one file: its face (settings, hooks) and its machinery
    {"config", "cli"},  # TrainConfig is the core sections and the techniques'
    {"data"},
    {"eval", "precompute"},  # precompute: the model's encoders run over a dataset (data.py precompute)
    {"callbacks"},
    {"trainer"},
    {"bench", "settings_docs"},
]
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "diffusion").rglob("*.py")):
        found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path] | None = None):
    """(module, line) of each diffusion import in ``path``, wherever it is (top level or inside a function); with
    ``known``, ``from diffusion.data import buckets`` names the submodule diffusion.data.buckets."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "diffusion":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                name = full if node.module == "diffusion" or (known and full in known) else node.module
                yield name, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "diffusion")


def test_every_module_has_a_layer_and_nothing_imports_upward():
    upward = []
    for module, path in modules().items():
        if module == "diffusion":
            continue
        mine = module.split(".")[1]
        assert mine in LEVEL, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
        for target, line in imports(path):
            theirs = target.split(".")[1]
            if LEVEL[theirs] > LEVEL[mine]:
                upward.append(f"{path.relative_to(ROOT)}:{line} {module} -> {target}")
    assert not upward, "imports upward:\n" + "\n".join(upward)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_data_imports_nothing_from_the_models_or_the_techniques():
    """The loaders get the model as an argument and what a technique adds as plain values (columns, checks)."""
    reached = [
        f"{path.relative_to(ROOT)}:{line} -> {target}"
        for module, path in modules().items()
        if module.startswith("diffusion.data")
        for target, line in imports(path)
        if target.split(".")[1] in ("models", "techniques")
    ]
    assert not reached, reached


def test_no_module_imports_one_that_imports_it_back():
    """Within a layer too (checkpointing/local.py and checkpointing/remote.py once imported each other, lazily): each
    arrow between two modules points one way, directly or around a longer circle."""
    known = modules()
    graph = {m: {t for t, _ in imports(p, known) if t in known and t != m} for m, p in known.items()}
    assert circles(graph) == [], "modules that import each other (directly or round a circle)"


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


HEAVY = ("torch", "composer", "diffusers", "transformers", "streaming")
# Settings an entry point refuses by their declaration alone (or a combination of them), each: the script's
# main, its arguments, and what its one line says. The check runs before the heavy imports (issue 55: ~12 s to a
# one-line usage error, measured 20-41 s on the 2-core VM while loaded; 0.6 s since).
BAD_SETTINGS = [
    ("train", ["yamls/sd-tiny-cpu.yaml", "batch_size=-1"], "batch_size=-1 must be a positive integer"),
    ("train", ["yamls/sd-tiny-cpu.yaml", "max_durration=10ba"], "unknown key 'max_durration'"),
    ("train", ["yamls/sd-tiny-cpu.yaml", "warmup=2sp"], "must count in one unit"),
    ("train", ["yamls/sd-tiny-cpu.yaml", "use_synth_data=true", "local=/d"], "both name the training data"),
    ("benchmark", ["--batch_size", "-1"], "--batch_size -1 must be a positive integer"),
    ("benchmark", ["--use_synth_data", "--remote", "s3://b/mds"], "names a dataset it would not read"),
    ("benchmark", ["--max_duration", "64sp", "--schedule", "cosine"], "must count in one unit"),
    ("export", ["sd-tinny", "/tmp/never-written"], "is no checkpoint (no such file or folder) and no preset"),
]


@pytest.mark.parametrize("script,args,says", BAD_SETTINGS, ids=[" ".join([s, *a[-2:]]) for s, a, _ in BAD_SETTINGS])
def test_a_bad_setting_is_refused_before_torch_composer_or_diffusers_is_imported(script, args, says):
    code = (
        f"import sys, {script}; code = {script}.main({args!r}); "
        f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=repo_env(), capture_output=True, text=True)
    assert done.stdout.split("\n")[0] == "2 []", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


LONGEST = 60  # lines of one function, from its def (or first decorator) to its last line


def test_no_function_in_diffusion_is_longer_than_60_lines():
    """A function that does one thing reads in one screen (issue 65: _build_trainer had 75 lines, callbacks 73)."""
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > LONGEST:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - first + 1}")
    assert not long, f"functions over {LONGEST} lines (split them):\n" + "\n".join(long)


def test_entry_points_and_eval_reach_a_technique_only_through_the_registry():
    """export.py, generate.py, the other entry points, cli.py and eval/ import ``diffusion.techniques`` (the registry
    and its hooks: export, scale_for_sampling, pipeline_loader), never a technique's module or its machinery."""
    paths = [ROOT / f"{name}.py" for name in ("export", "generate", "evaluate", "train", "benchmark", "data")]
    paths += [ROOT / "diffusion" / "cli.py", *sorted((ROOT / "diffusion" / "eval").glob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{line} {target}"
        for path in paths
        for target, line in imports(path)
        if target.startswith("diffusion.techniques.")
    ]
    assert not found, "imports of a technique's own modules:\n" + "\n".join(found)
