"""HF-shaped model outputs that are also JAX pytrees (so they can leave a jitted function)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
    """`loss` (when labels were given) and `logits`, readable as HF's ModelOutput: by key, attribute or index."""

    loss: jax.Array | None = None
    logits: jax.Array | None = None
    cache: Any = None  # the updated KV cache when the model was called with one (generation)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for v in (getattr(self, f.name) for f in dataclasses.fields(self)) if v is not None)

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def values(self) -> list[Any]:
        return [getattr(self, k) for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]


class Outputs(dict):
    """Model outputs by name, in the model's order, readable as HF's ModelOutput (by key, attribute or index;
    `.get`, `.keys()`, `.items()`, `to_tuple()`), and a JAX pytree, so they can leave a jitted function."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


jax.tree_util.register_pytree_with_keys(
    Outputs,
    lambda out: ([(jax.tree_util.DictKey(k), v) for k, v in out.items()], tuple(out.keys())),
    lambda keys, values: Outputs(zip(keys, values)),
)
