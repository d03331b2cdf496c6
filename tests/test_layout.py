"""The layout: packages by stage, each importing only from the stages before it and the base."""

from __future__ import annotations

import ast
from pathlib import Path

import mtrain

PACKAGE = Path(mtrain.__file__).parent
# The stages in the order data flows; a module may import from its own stage and earlier ones.
STAGES = [
    "core",
    "data",
    "model",
    "run",
    "decoding",
    "figures",
    "training",
    "export",
    "laboratory",
    "serve",
    "commands",
]
TOP = len(STAGES)  # mtrain/__init__.py, cli.py, __main__.py, translation_model.py: the faces,
# free to import any stage, imported by no stage


def stage(module: str) -> int:
    """The stage of a dotted module name under mtrain."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in STAGES:
        return TOP
    return STAGES.index(parts[1])


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """Every mtrain module `path` imports, at any depth (lazy imports inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "mtrain":
                found += [(node.lineno, f"mtrain.{alias.name}") for alias in node.names]
            elif node.module.startswith("mtrain."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("mtrain.")]
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_lives_in_a_stage_package() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py")]
    assert sorted(loose) == ["__init__.py", "__main__.py", "cli.py", "translation_model.py"]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(STAGES)


def test_each_package_says_what_it_owns() -> None:
    for name in STAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"mtrain/{name}/__init__.py needs a docstring"


def test_a_stage_imports_only_from_stages_before_it() -> None:
    wrong = []
    for path in modules():
        here = module_name(path)
        for line, imported in imports(path):
            if stage(imported) > stage(here):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    """The rule above fails on a data module that imports training (the test can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from mtrain.training.trainer import Trainer\n")
    assert [stage(m) for _, m in imports(bad)] == [STAGES.index("training")]
    assert stage("mtrain.data.corpus") < stage("mtrain.training.trainer")
    assert stage("mtrain.cli") == TOP


def commands_imports(here: str, path: Path) -> list[tuple[int, str]]:
    """Where module `here` (at `path`) imports mtrain.commands: only cli.py and commands/ may."""
    if here == "mtrain.cli" or stage(here) == STAGES.index("commands"):
        return []
    return [(line, m) for line, m in imports(path) if m.split(".")[:2] == ["mtrain", "commands"]]


def test_only_the_command_line_imports_the_commands() -> None:
    """The library (the faces `__init__.py` and `translation_model.py` too) never leans on the
    command line: `mtrain.train`, `mtrain.lab` and `mtrain train` all call the library."""
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
        for path in modules()
        for line, imported in commands_imports(module_name(path), path)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_of_the_commands(tmp_path: Path) -> None:
    """The rule above fails on a face or a stage that imports a command (the test can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from mtrain import commands\n\ndef f():\n    from mtrain.commands.train import train\n"
    )
    found = [(1, "mtrain.commands"), (4, "mtrain.commands.train")]
    assert commands_imports("mtrain", bad) == found
    assert commands_imports("mtrain.laboratory.runner", bad) == found
    assert commands_imports("mtrain.cli", bad) == commands_imports("mtrain.commands.lab", bad) == []


def variant_tables(path: Path, names: set[str]) -> list[int]:
    """The lines of `path` where a dict's keys or a set's elements name two model variants or
    more: a table of the variants, which only their one declaration may hold."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            items = node.keys
        elif isinstance(node, ast.Set):
            items = node.elts
        else:
            continue
        named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
        if len(named) >= 2:
            found.append(node.lineno)
    return found


def test_the_model_variants_are_declared_once() -> None:
    """core/config.py's MODEL_VARIANTS; the model, the config check, the lab and the exporter
    read it."""
    from mtrain.core.config import MODEL_VARIANTS

    declared = PACKAGE / "core" / "config.py"
    assert variant_tables(declared, set(MODEL_VARIANTS)) != []  # the check sees the declaration
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in modules()
        if path != declared
        for line in variant_tables(path, set(MODEL_VARIANTS))
    ]
    assert not wrong, "a second table of the model variants: " + ", ".join(wrong)


# The most lines a definition may span: a class, a function (methods included), and the
# Trainer, which only runs the loop (training/build.py assembles its parts).
MAX_CLASS, MAX_FUNCTION, MAX_TRAINER = 180, 60, 150


def oversized(path: Path) -> list[str]:
    """The classes and functions of `path` longer than their limit, with their lengths."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            limit = MAX_TRAINER if node.name == "Trainer" else MAX_CLASS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            found.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines, at most {limit}")
    return found


def test_classes_and_functions_stay_within_their_size() -> None:
    wrong = [line for path in modules() for line in oversized(path)]
    assert not wrong, "\n".join(wrong)


def test_the_size_check_sees_a_long_function(tmp_path: Path) -> None:
    """The limits above fail on a function of 61 lines and a Trainer of 152 (they can fail)."""

    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    trainer = "class Trainer:\n" + lines(90, "    ") + "    def g(self):\n" + lines(60, " " * 8)
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + lines(60, "    ") + "\n\n" + trainer)
    found = sorted(line.split()[1] for line in oversized(long))
    assert found == ["Trainer:", "f:", "g:"]
    long.write_text("def f():\n" + lines(59, "    "))
    assert oversized(long) == []
