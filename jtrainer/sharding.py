"""The one place a Mesh is built, and the shardings of the train state and of batches.

For now every device is on the `data` axis: parameters and optimizer state are replicated, batches are split
over rows. The step itself is written for any mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA = "data"


def make_mesh(devices=None) -> Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices())
    return Mesh(devices.reshape(-1), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def rows_sharding(mesh: Mesh, row_dim: int) -> NamedSharding:
    """Split dimension `row_dim` (the batch rows) over the data axis."""
    return NamedSharding(mesh, P(*([None] * row_dim), DATA))


def check_rows_divisible(rows: int, mesh: Mesh, what: str) -> None:
    n = mesh.shape[DATA]
    if rows % n:
        raise ValueError(
            f"{what} of {rows} rows cannot be split over {n} data-parallel devices: use a multiple of {n}."
        )


def put_rows(batch, mesh: Mesh, row_dim: int):
    """Place a numpy pytree on devices, rows split over the data axis (sharded leaves of rank > row_dim)."""

    def place(x):
        x = np.asarray(x)
        sharding = rows_sharding(mesh, row_dim) if x.ndim > row_dim else replicated(mesh)
        return jax.device_put(x, sharding)

    return jax.tree.map(place, batch)
