"""The front page and the manual: README.md stays a front page (what this is, the install, the one-minute run,
the test commands CI runs, a map to docs/), and every link in README.md, docs/ and docker/README.md leads to a
file and heading that exist."""

import re

from conftest import REPO

DOCS = [REPO / "README.md", REPO / "docker" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+\s+(.+?)\s*$", without_code(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_the_readme_is_a_front_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "move the manual into docs/ and link it"
    headings = re.findall(r"^## (.+)$", without_code(text), flags=re.M)
    assert headings[:3] == ["Install", "Run: a one-minute benchmark on a laptop CPU", "Test"], headings
    assert 'pip install -e ".[dev,fp8]"' in text
    for doc in ("install", "benchmark", "training", "testing", "data", "multi-node", "reliability", "architecture"):
        assert f"(docs/{doc}.md" in text, doc


def test_the_readmes_test_commands_are_the_ones_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    section = (REPO / "README.md").read_text().split("## Test", 1)[1].split("\n## ", 1)[0]
    commands = [c.strip() for c in re.findall(r"^(?:pip install|python -m pytest)[^#\n]*", section, flags=re.M)]
    assert len(commands) >= 3, commands
    for command in commands:
        if command.startswith("pip install"):  # CI runs the venv's ruff by path: "$pinned/bin/ruff" check .
            assert all(f'ruff" {step}' in ci for step in ("check .", "format --check .")), command
        else:
            assert command in ci, f"README's {command!r} is not what .ci/run runs"


def test_every_link_in_the_docs_leads_somewhere():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(without_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto:
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in set(anchors(file.read_text())):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_heading_anchors_follow_github():
    assert list(anchors("# A: b-c\n```\n# not a heading\n```\n## A: b-c\n### MFU (dense)")) == [
        "a-b-c",
        "a-b-c-1",
        "mfu-dense",
    ]


def test_every_module_is_named_in_the_architecture():
    """docs/architecture.md says what each module is for: a module under diffusion/ it does not name fails here."""
    text = (REPO / "docs/architecture.md").read_text()
    modules = sorted(p for p in (REPO / "diffusion").rglob("*.py") if p.name != "__init__.py")
    missing = [str(p.relative_to(REPO)) for p in modules if p.name not in text]
    assert missing == [], f"name these in docs/architecture.md (module table): {missing}"


def test_the_current_stacks_selection_names_tests_that_exist():
    """conftest's STACK_TESTS (single tests the current set runs) and STACK_FILES name tests and files that exist: a
    renamed test would leave the selection without a word."""
    from conftest import STACK_FILES, STACK_TESTS

    assert all((REPO / "tests" / name).is_file() for name in STACK_FILES), STACK_FILES
    for nodeid in STACK_TESTS:
        path, name = nodeid.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{nodeid} does not exist"


def layout_entries() -> dict[str, str]:
    """docs/architecture.md's layout tree (section 7): each entry's first column (a path) -> its words."""
    text = (REPO / "docs/architecture.md").read_text()
    tree = text.split("## 7. Layout", 1)[1].split("```", 2)[1]
    entries, current = {}, None
    for line in tree.splitlines():
        if line[:1] not in ("", " "):
            current, _, words = line.partition(" ")
            entries[current] = words
        elif current:
            entries[current] += " " + line.strip()
    return entries


def test_the_layout_tree_names_each_packages_modules_and_only_those():
    """Each package of diffusion/ has its line in the layout tree, naming each of its modules and sub-packages; a
    module a line names that is not in its package (a moved or removed file) fails too."""
    entries = layout_entries()
    wrong = []
    for package in sorted(p for p in (REPO / "diffusion").iterdir() if (p / "__init__.py").is_file()):
        key = f"diffusion/{package.name}/"
        if key not in entries:
            wrong.append(f"{key}: no line")
            continue
        words = entries[key]
        present = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
        present |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
        wrong += [f"{key}: {name} not named" for name in sorted(present) if name not in words]
        inside = {p.name for p in package.rglob("*.py")}
        wrong += [f"{key}: names {name}, not in it" for name in re.findall(r"\b\w+\.py\b", words) if name not in inside]
    assert not wrong, "docs/architecture.md's layout tree (section 7):\n" + "\n".join(wrong)
