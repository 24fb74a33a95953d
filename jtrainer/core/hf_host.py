"""transformers' host-side modules (TrainingArguments, the callbacks, trainer_utils) imported without torch.

Those modules import torch, accelerate and peft at module level whenever they are installed, only to use them
in functions jtrainer never calls or calls only once a torch model is in play: importing them as they are costs
seconds and every library's import chatter (bitsandbytes' kernel hub through peft). `import_host_modules`
imports them while transformers reports the three packages missing, then binds each name their guarded imports
would have bound to a stand-in that imports the real object on first use: the modules behave as transformers
wrote them, and torch loads when torch code first touches them (the bridge, a side-by-side transformers.Trainer).
Nothing is deferred once torch is imported (a script that imported torch or transformers.Trainer first).
`jtrainer/__init__.py` calls `import_host_modules`; `tests/test_startup.py` checks the names bound against an
import with torch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_HIDDEN = ("is_torch_available", "is_accelerate_available", "is_peft_available")
_GUARD = re.compile(r"^if .*(" + "|".join(_HIDDEN) + ")", re.MULTILINE)  # a top-level guarded block


def _load(target: str) -> Any:
    """`package.module` (the module) or `package.module:attribute` (an attribute, else a submodule)."""
    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module)
    if not attribute:
        return loaded
    try:
        return getattr(loaded, attribute)
    except AttributeError:
        return importlib.import_module(f"{module}.{attribute}")


def _resolve(owner: str, name: str, target: str, package: str | None = None) -> Any:
    """The real object of a stand-in, imported now and bound in its place in `owner` (`package`: what `import
    package.submodule` binds)."""
    real = _load(target)
    if package:
        real = importlib.import_module(package)
    setattr(sys.modules[owner], name, real)
    return real


class _DeferredModule(types.ModuleType):
    """A module name bound in place of `import torch`: the real module is imported (and bound in its owner's
    namespace) on first attribute access."""

    def __init__(self, owner: str, name: str, target: str, binds: str | None = None):
        super().__init__(binds or target)
        self._jtrainer_deferred = (owner, name, target, binds)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(_resolve(*self.__dict__["_jtrainer_deferred"]), attribute)


class _DeferredClass(type):
    """A class name bound in place of `from peft import PeftModel`: calls and attributes go to the real class
    (imported then); `isinstance` is False without importing while the class's module is not loaded (nothing
    can be an instance of it yet)."""

    _jtrainer_deferred: tuple[str, str, str]

    def _real(cls) -> Any:
        return _resolve(*cls._jtrainer_deferred)

    def _real_if_loaded(cls) -> Any:
        module = cls._jtrainer_deferred[2].partition(":")[0]
        return cls._real() if module in sys.modules else None

    def __instancecheck__(cls, instance: Any) -> bool:
        real = cls._real_if_loaded()
        return real is not None and isinstance(instance, real)

    def __subclasscheck__(cls, subclass: Any) -> bool:
        real = cls._real_if_loaded()
        return real is not None and issubclass(subclass, real)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(cls._real(), attribute)


def _deferred_attribute(owner: str, name: str, target: str) -> Any:
    """A stand-in for `from package import name`: a class, a function or a submodule alike."""
    return _DeferredClass(name, (), {"_jtrainer_deferred": (owner, name, target), "__module__": owner})


@contextmanager
def _packages_reported_missing() -> Iterator[dict[str, Callable[..., bool]]]:
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    real = {name: getattr(import_utils, name) for name in _HIDDEN}
    for name in _HIDDEN:
        for module in (utils, import_utils):
            setattr(module, name, _reported_missing)
    try:
        yield real
    finally:
        for name, check in real.items():
            for module in (utils, import_utils):
                setattr(module, name, check)


def _reported_missing(*args: Any, **kwargs: Any) -> bool:
    return False


@contextmanager
def torch_deferred() -> Iterator[None]:
    """Inside, transformers modules imported for the first time find torch, accelerate and peft missing; on
    leaving, each is given the real availability checks back and stand-ins for what its guarded imports bind.
    Nothing is deferred once torch is loaded (a script that imported torch or transformers.Trainer first)."""
    if "torch" in sys.modules:
        yield
        return
    before = set(sys.modules)
    with _packages_reported_missing() as real:
        yield
    from transformers.utils.import_utils import _LazyModule

    for name in sorted(set(sys.modules) - before):
        module = sys.modules[name]
        if not name.startswith("transformers"):
            continue
        if isinstance(module, _LazyModule):  # a package whose table of names depends on torch: built again
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, importlib.import_module(name))
        elif isinstance(module, types.ModuleType):
            _bind_guarded_imports(module, real)
    if "transformers.training_args" in sys.modules:
        _restore_parallelism_config_field()


def _bind_guarded_imports(module: types.ModuleType, real: dict[str, Callable[..., bool]]) -> None:
    """Give `module` the real checks back, then do what its top-level `if is_torch_available(): import ...`
    blocks would have done: imports become stand-ins; any other statement runs now (a guarded block that
    defines something cannot wait)."""
    for name, check in real.items():
        if module.__dict__.get(name) is _reported_missing:
            setattr(module, name, check)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return
    with open(path, encoding="utf-8") as file:
        source = file.read()
    if not _GUARD.search(source):
        return
    _run_guarded(ast.parse(source).body, module, path)


def _run_guarded(statements: list[ast.stmt], module: types.ModuleType, path: str, guarded: bool = False) -> None:
    for statement in statements:
        if isinstance(statement, ast.If):
            test = ast.unparse(statement.test)
            if not guarded and not any(name in test for name in _HIDDEN):
                continue  # ran at import as written
            if eval(compile(ast.Expression(statement.test), path, "eval"), module.__dict__):
                _run_guarded(statement.body, module, path, guarded=True)
            else:
                _run_guarded(statement.orelse, module, path, guarded=guarded)
        elif not guarded:
            continue
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    setattr(module, alias.asname, _DeferredModule(module.__name__, alias.asname, alias.name))
                else:  # `import torch.distributed` binds `torch`
                    top = alias.name.partition(".")[0]
                    setattr(module, top, _DeferredModule(module.__name__, top, alias.name, top))
        elif isinstance(statement, ast.ImportFrom):
            source = importlib.util.resolve_name("." * statement.level + (statement.module or ""), module.__package__)
            for alias in statement.names:
                bound = alias.asname or alias.name
                setattr(module, bound, _deferred_attribute(module.__name__, bound, f"{source}:{alias.name}"))
        else:
            code = compile(ast.Module(body=[statement], type_ignores=[]), path, "exec")
            exec(code, module.__dict__)


# What jtrainer's modules import from transformers at module level, and those of them whose top-level imports
# of torch, accelerate or peft are guarded by an availability check (tests/test_startup.py checks that
# importing every jtrainer module outside the bridge loads no torch).
HOST_MODULES = (
    "transformers.trainer_utils",
    "transformers.training_args",
    "transformers.training_args_seq2seq",
    "transformers.trainer_callback",
    "transformers.hf_argparser",
    "transformers.debug_utils",
    "transformers.configuration_utils",
    "transformers.modeling_rope_utils",
    "transformers.utils.type_validators",
    "transformers.image_utils",
    "transformers.image_transforms",
    "transformers.video_utils",
    "transformers.generation.configuration_utils",
)


def import_host_modules() -> None:
    """Import HOST_MODULES without torch (see the module docstring)."""
    with torch_deferred():
        for name in HOST_MODULES:
            importlib.import_module(name)


def _restore_parallelism_config_field() -> None:
    """The one deferred class a dataclass field is typed with: transformers typed it with the real class."""
    training_args = sys.modules["transformers.training_args"]
    stand_in = training_args.__dict__.get("ParallelismConfig")
    if isinstance(stand_in, _DeferredClass) and hasattr(training_args, "TrainingArguments"):
        field = training_args.TrainingArguments.__dataclass_fields__["parallelism_config"]
        field.type = stand_in | None
