"""The Trainer's parts and the state they share: every attribute a part assigns is declared in
jtrainer.trainer_parts, and only its owner assigns it (or the parts SHARED names)."""

import ast
import os

from jtrainer import trainer_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("trainer", "optimizer_setup", "evaluation", "saving", "hpsearch", "hub", "metrics_io")


def _targets(node):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _targets(element)]
    return []


def _writes() -> dict[str, set[str]]:
    """Attribute -> the parts whose classes assign `self.<attribute>`."""
    found: dict[str, set[str]] = {}
    for part in PARTS:
        tree = ast.parse(open(os.path.join(ROOT, "jtrainer", f"{part}.py")).read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
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
    from jtrainer.evaluation import EvaluationMixin
    from jtrainer.hpsearch import HyperparameterSearchMixin
    from jtrainer.hub import HubMixin
    from jtrainer.metrics_io import MetricsMixin
    from jtrainer.optimizer_setup import OptimizerMixin
    from jtrainer.saving import SavingMixin
    from jtrainer.trainer import Trainer

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
