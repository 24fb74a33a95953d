"""The package's import graph: no cycle (counting imports inside functions too), the layers (each subpackage
imports only its own layer and those below it; the CLI above everything), and every module importable on its
own."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the jtrainer package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "jtrainer")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The jtrainer modules `name` imports anywhere in its file (`from pkg import sub` counts as `pkg.sub`), but
    under `if TYPE_CHECKING:`."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(open(path).read())
    for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
        block.body = []  # imports for type checkers only: never run
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base in modules:
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    found.discard(name)
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 40 and "jtrainer.cli.check" in graph
    assert _cycles(graph) == [], "\n".join(" -> ".join(c) for c in _cycles(graph))


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


# The layers, bottom first. A module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core",)),  # settings, errors, HF's host-side classes, storage paths: no jtrainer imports above
    ("parallel", ("parallel",)),  # the mesh, many processes
    ("runtime", ("runtime",)),  # process start-up, malloc tuning, the compiled-step cache
    ("numerics", ("numerics",)),  # the step, losses, optimizers, schedules: pure functions
    ("models", ("models",)),  # the native families, their kernels, generation and sequence packing
    ("bridge", ("bridge",)),  # transformers' torch models under the step
    ("checkpointing", ("checkpointing",)),
    ("kinds", ("kinds",)),  # what the Trainer asks of a model, one room per kind (native, bridged)
    ("sizing", ("sizing",)),
    ("trainer", ("trainer",)),  # HF's front end and the loop
    ("trl", ("trl",)),  # TRL's trainers on the Trainer
    ("cli", ("cli",)),  # the `jtrainer` command
]


def _layer(module: str) -> int:
    """The index in LAYERS of a jtrainer module (the package's __init__, the public API, sits with the CLI)."""
    if module == "jtrainer":
        return len(LAYERS) - 1
    first = module.split(".")[1]
    return next(i for i, (_, members) in enumerate(LAYERS) if first in members)


def test_every_module_lives_in_a_named_package():
    """No loose modules beside the packages: the tree shows the layers (the package's __init__ is the public API)."""
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "jtrainer")) if f.endswith(".py"))
    assert top == ["__init__.py"]
    folder = os.path.join(ROOT, "jtrainer")
    packages = {f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f, "__init__.py"))}
    assert packages == {member for _, members in LAYERS for member in members}


def test_every_module_belongs_to_a_layer():
    unplaced = []
    for name in _modules():
        try:
            _layer(name)
        except StopIteration:
            unplaced.append(name)
    assert unplaced == []


def test_no_module_imports_a_layer_above_its_own():
    upward = {
        name: sorted(dep for dep in deps if _layer(dep) > _layer(name))
        for name, deps in _graph().items()
        if any(_layer(dep) > _layer(name) for dep in deps)
    }
    assert upward == {}, {name: (LAYERS[_layer(name)][0], deps) for name, deps in upward.items()}


def test_the_layer_rule_finds_an_upward_import():
    assert _layer("jtrainer.numerics.step") < _layer("jtrainer.trainer.trainer") < _layer("jtrainer.cli.check")
    assert _layer("jtrainer.core.state") < _layer("jtrainer.parallel.sharding")


def test_the_cli_is_the_application_layer():
    """Nothing in the library imports the command's package."""
    offenders = {
        name: sorted(i for i in deps if i.startswith("jtrainer.cli"))
        for name, deps in _graph().items()
        if not name.startswith("jtrainer.cli")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_module_imports_on_its_own():
    names = sorted(name for name in _modules() if not name.endswith(".__main__"))  # __main__ runs the command
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'jtrainer' or m.startswith('jtrainer.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(" + repr(names) + "))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(names)}" in done.stdout


def test_model_families_share_layers_not_each_other():
    """What the families share lives in jtrainer.models.layers; no family imports another."""
    families = {f"jtrainer.models.{name}" for name in ("bert", "gpt2", "llama", "t5")}
    graph = _graph()
    assert {name: sorted(graph[name] & families) for name in families} == {name: [] for name in families}
    assert all("jtrainer.models.layers" in graph[name] for name in families)


def _third_party_imports(path: str) -> set[str]:
    """The top-level packages outside jtrainer a file imports anywhere (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_trainer_imports_neither_torch_nor_the_bridge():
    """The Trainer holds a model through `jtrainer.kinds` (one protocol, a room per kind), so trainer/ never asks
    which kind it holds: no module of it imports the bridge, torch, torchax or peft."""
    modules = _modules()
    graph = _graph()
    trainer = [name for name in modules if name.startswith("jtrainer.trainer")]
    assert len(trainer) > 10
    bridged = {name: sorted(d for d in graph[name] if d.startswith("jtrainer.bridge")) for name in trainer}
    assert {name: deps for name, deps in bridged.items() if deps} == {}
    torch_side = {"torch", "torchax", "peft"}
    found = {name: sorted(_third_party_imports(modules[name]) & torch_side) for name in trainer}
    assert {name: deps for name, deps in found.items() if deps} == {}
    assert "jtrainer.kinds" in graph["jtrainer.trainer.trainer"]  # the one way in


def test_the_trainer_names_neither_torch_nor_the_bridge():
    """No name in trainer/'s code (its docstrings, comments and messages aside) speaks of torch or the bridge,
    but HF's own argument names (`torch_compile`, `torch_empty_cache_steps`, ...): a user's torch optimizer is
    a translated optimizer, transformers.Trainer's checkpoints are HF's, torch code a user wrote is an
    alternative way to run their function."""
    import dataclasses
    import io
    import pathlib
    import re
    import tokenize

    import transformers

    hf_arguments = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    named = []
    for path in sorted(pathlib.Path(ROOT, "jtrainer", "trainer").glob("*.py")):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.NAME and re.search("torch|bridge", token.string, re.IGNORECASE):
                if token.string not in hf_arguments:
                    named.append(f"{path.name}:{token.start[0]}: {token.string}")
    assert named == []
