"""The Trainer's parts and the state they share: every attribute a part assigns is declared in
jtrainer.trainer.trainer_parts, and only its owner assigns it (or the parts SHARED names)."""

import ast
import os

from jtrainer.trainer import trainer_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("trainer", "optimizer_setup", "evaluation", "saving", "hpsearch", "hub", "metrics_io", "seq2seq")
CALLERS = PARTS  # Seq2SeqTrainer extends the Trainer; evaluation calls its generation hooks
# The names a part's code calls a Trainer by: `self` in its methods, `trainer` in a module-level function.
TRAINER_NAMES = ("self", "trainer")


def _module(part: str) -> ast.Module:
    return ast.parse(open(os.path.join(ROOT, "jtrainer", "trainer", f"{part}.py")).read())


def _classes(part: str):
    return [n for n in _module(part).body if isinstance(n, ast.ClassDef)]


def _is_part(cls: ast.ClassDef) -> bool:
    """A class of the Trainer's (a part, the Trainer, Seq2SeqTrainer), not a helper class whose `self` is its own."""
    names = {base.id for base in cls.bases if isinstance(base, ast.Name)}
    return bool(names & {"TrainerParts", "Trainer"}) or any(name.endswith("Mixin") for name in names)


def _targets(node):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in TRAINER_NAMES:
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _targets(element)]
    return []


def _writes() -> dict[str, set[str]]:
    """Attribute -> the parts whose code (methods and module-level functions alike) assigns `self.<attribute>`
    or `trainer.<attribute>`."""
    found: dict[str, set[str]] = {}
    for part in PARTS:
        code = [n for n in _module(part).body if not isinstance(n, ast.ClassDef) or _is_part(n)]
        for node in (inner for top in code for inner in ast.walk(top)):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for name in _targets(target):
                    found.setdefault(name, set()).add(part)
    return found


def test_the_writer_finder_sees_module_level_functions():
    tree = ast.parse("def f(trainer):\n    trainer._train_state = None\n")
    assign = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign))
    assert _targets(assign.targets[0]) == ["_train_state"]


def test_every_assigned_attribute_is_declared_with_its_owner():
    writes = _writes()
    declared = set(trainer_parts.TrainerParts.__annotations__)
    assert set(writes) <= declared, sorted(set(writes) - declared)
    assert declared == set(trainer_parts.OWNER), sorted(declared ^ set(trainer_parts.OWNER))
    assert set(trainer_parts.OWNER.values()) <= set(PARTS)


def test_only_the_owner_assigns_an_attribute():
    wrong = {}
    for name, parts in _writes().items():
        allowed = set(trainer_parts.SHARED.get(name, ())) | {trainer_parts.OWNER[name]}
        if parts - allowed:
            wrong[name] = sorted(parts - allowed)
    assert wrong == {}


def test_every_part_derives_from_the_declaration():
    from jtrainer.trainer.evaluation import EvaluationMixin
    from jtrainer.trainer.hpsearch import HyperparameterSearchMixin
    from jtrainer.trainer.hub import HubMixin
    from jtrainer.trainer.metrics_io import MetricsMixin
    from jtrainer.trainer.optimizer_setup import OptimizerMixin
    from jtrainer.trainer.saving import SavingMixin
    from jtrainer.trainer.trainer import Trainer

    for part in (
        EvaluationMixin,
        HyperparameterSearchMixin,
        HubMixin,
        MetricsMixin,
        OptimizerMixin,
        SavingMixin,
        Trainer,
    ):
        assert issubclass(part, trainer_parts.TrainerParts), part


def _methods_and_uses():
    """Method name -> the parts that define it; part -> the `self.<name>` it uses."""
    defined: dict[str, set[str]] = {}
    used: dict[str, set[str]] = {}
    for part in CALLERS:
        for cls in _classes(part):
            for node in cls.body:
                # properties (`model`) are declared as attributes
                if isinstance(node, ast.FunctionDef) and node.name not in trainer_parts.TrainerParts.__annotations__:
                    defined.setdefault(node.name, set()).add(part)
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    used.setdefault(part, set()).add(node.attr)
    return defined, used


def _declared_methods() -> set[str]:
    """The methods TrainerParts declares (under `if TYPE_CHECKING:` in its body)."""
    tree = ast.parse(open(os.path.join(ROOT, "jtrainer", "trainer", "trainer_parts.py")).read())
    parts = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainerParts")
    return {
        f.name
        for block in parts.body
        if isinstance(block, ast.If)
        for f in block.body
        if isinstance(f, ast.FunctionDef)
    }


def test_every_cross_part_call_is_declared_with_the_part_that_defines_it():
    defined, used = _methods_and_uses()
    cross = {
        name: sorted(defined[name])
        for part, names in used.items()
        for name in names
        if name in defined and part not in defined[name]
    }
    # A method two parts define (a hook Seq2SeqTrainer overrides) belongs to the first that defines it.
    owners = {name: next(p for p in CALLERS if p in parts) for name, parts in cross.items()}
    assert owners == trainer_parts.CALLS
    assert _declared_methods() == set(trainer_parts.CALLS)
