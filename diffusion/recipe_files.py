"""Reading one recipe file (train.py's yaml) safely: whatever the file holds, one line that names it and the
line in it, never a traceback and never a run that eats the machine before a key is checked.

YAML's anchors and aliases (``&a`` / ``*a``) let a few hundred bytes stand for billions of values (the
"billion laughs" bomb: each level repeats the one before ten times). PyYAML builds such a document cheaply,
sharing one object per anchor, but OmegaConf copies every reference into a node of its own, so a 1 KB recipe
grew past 2.5 GB before any key was checked. Here the document is composed first (yaml's node graph, where an
alias is the same node again), its size as OmegaConf would expand it counted with one visit per node, and a
document that expands past MAX_VALUES refused before anything is built. The rest is PyYAML's own parsing with
OmegaConf's loader (its duplicate-key check and its float syntax, so a value reads as it always did).
"""

from __future__ import annotations

import os
import re

from diffusion.errors import UsageError

# Values (scalars, lists and mappings) a recipe may expand to. The largest recipe in yamls/ has a few hundred;
# a prompt list of thousands still fits. OmegaConf needs about 1 KB per value: 100k is ~100 MB at most.
MAX_VALUES = 100_000


def read_recipe(path: str) -> tuple[dict, dict[str, int]]:
    """(the recipe at ``path`` as a dict, the line of each key: 'lr' -> 3, 'objective.shift' -> 7). A path that is
    not a readable UTF-8 yaml mapping of bounded size is a UsageError naming the file (and line)."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    text = _text(path)
    loader = get_yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, {}
        values = _expanded_size(node, {}, set())
        if values > MAX_VALUES:
            raise UsageError(
                f"{path}: its anchors and aliases (&name, *name) expand to more than {MAX_VALUES:,} values; "
                "a recipe this size is an alias bomb or a mistake: write the values out, or use fewer aliases"
            )
        data = loader.construct_document(node)
        _check_numbers(loader, node)
    except yaml.YAMLError as e:
        raise UsageError(f"{path}{_where(e)}: not valid yaml: {_problem(e)}") from None
    except _OutOfRange as e:
        raise UsageError(f"{path}, line {e.line}: {e}") from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply to be a recipe") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: a recipe is a mapping of 'key: value' lines, this file holds a {_kind(data)}; see yamls/ "
            "for the recipes"
        )
    return data, _key_lines(node, "")


def _text(path: str) -> str:
    if os.path.isdir(path):
        raise UsageError(f"recipe {path!r} is a directory, not a yaml file; pass one of its .yaml files")
    if not os.path.isfile(path):
        raise UsageError(f"recipe {path!r} does not exist; see yamls/ for the recipes")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"recipe {path!r} cannot be read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UsageError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the recipe "
            "as UTF-8"
        ) from None


def _expanded_size(node, seen: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` becomes once every alias is copied out (OmegaConf's view), each node visited once;
    a node that contains itself is refused (it would expand forever)."""
    import yaml

    key = id(node)
    if key in seen:
        return seen[key]
    if key in open_nodes:
        raise yaml.YAMLError("an alias refers to a node that contains it (it would expand forever)")
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, seen, open_nodes)
        if total > MAX_VALUES:  # no need to count the rest (and no risk of huge integers)
            break
    open_nodes.discard(key)
    seen[key] = total
    return total


def check_override(text: str) -> None:
    """A ``key=value`` override's value read as OmegaConf will read it (yaml), its numbers in range: else a
    UsageError naming the override."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    key, _, value = text.partition("=")
    loader = get_yaml_loader()(value)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_numbers(loader, node, key)
    except yaml.YAMLError as e:
        raise UsageError(f"command line: {text[:80]!r}: not valid yaml: {_problem(e)}") from None
    except _OutOfRange as e:
        raise UsageError(f"command line: {e}") from None
    finally:
        loader.dispose()


class _OutOfRange(Exception):
    """A number that fits no float or integer a run uses (raised by _check_numbers)."""

    def __init__(self, key: str, node):
        text = node.value if len(node.value) <= 24 else node.value[:24] + "..."
        super().__init__(
            f"{key}{': ' if key else ''}the number {text} is out of range (a float reaches about 1.8e308, an integer "
            "2**63); write the value the key needs"
        )
        self.line = node.start_mark.line + 1


def _check_numbers(loader, node, key: str = "") -> None:
    """Every number under ``node`` fits a float (1e400 reads as inf, a 400-digit integer fits nothing): else
    _OutOfRange for the first that does not. Written infinities (.inf) and .nan are left to the key's check."""
    import math

    import yaml

    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            _check_numbers(loader, value_node, f"{key}.{key_node.value}".lstrip(".") if key_node.tag else key)
    elif isinstance(node, yaml.SequenceNode):
        for child in node.value:
            _check_numbers(loader, child, key)
    elif node.tag in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int"):
        value = loader.construct_object(node)
        if isinstance(value, int) and abs(value) >= 2**63:
            raise _OutOfRange(key, node)
        if isinstance(value, float) and not math.isfinite(value) and not re.search("inf|nan", node.value, re.I):
            raise _OutOfRange(key, node)


def _key_lines(node, prefix: str) -> dict[str, int]:
    """The 1-based line of each mapping key under ``node``, dotted ('objective.shift'); the first wins."""
    import yaml

    lines: dict[str, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = f"{prefix}{key_node.value}"
        lines.setdefault(key, key_node.start_mark.line + 1)
        for sub, line in _key_lines(value_node, key + ".").items():
            lines.setdefault(sub, line)
    return lines


def _where(error) -> str:
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return f", line {mark.line + 1}" if mark is not None else ""


def _problem(error) -> str:
    problem = getattr(error, "problem", None)
    if not problem:
        return (str(error).splitlines() or [type(error).__name__])[0]
    if problem.startswith("found duplicate key"):
        key = problem.removeprefix("found duplicate key").strip()
        return f"key '{key}' is given twice (which one wins is not clear); keep one"
    context = getattr(error, "context", None)
    return f"{problem} ({context})" if context else problem


def _kind(data) -> str:
    if data is None:
        return "null"
    if isinstance(data, list):
        return f"list of {len(data)} item(s)"
    return f"single {type(data).__name__} value ({str(data)[:40]!r})"
