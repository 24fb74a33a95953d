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
