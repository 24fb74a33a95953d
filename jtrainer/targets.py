"""Accelerators that are not here, for `jtrainer check --target`: compile-only devices with their chip's memory
and peak rates, so a run is sized before a slice is rented.

TPU targets are libtpu's compile-only topologies (`pip install "jax[tpu]==<the jax in use>"`; nothing is run and
no TPU is contacted), named as gcloud names accelerator types: `v4-N` and `v5p-N` count TensorCores (two per
chip), `v5litepod-N` (alias `v5e-N`) and `v6e-N` count chips; `num_slices` > 1 gives a multi-slice target
whose slices are joined by the data-center network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from jtrainer.errors import BadInput

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: what libtpu calls it, its memory and bandwidth (peak FLOP/s: `throughput`)."""

    topology_prefix: str  # libtpu's topology name prefix
    device_kind: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    cores_in_name: int  # gcloud's accelerator type counts TensorCores (2 per chip) or chips (1)
    torus_dims: int
    chip_config: str  # "megacore": the chip's two TensorCores are one device, as jax shows a v4 chip


TPU_CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 1.2e12, 2, 3, "megacore"),
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2.76e12, 2, 3, "default"),
    "v5litepod": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 1, 2, "default"),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1.64e12, 1, 2, "default"),
}
_ALIASES = {"v5e": "v5litepod"}
EXAMPLES = "v4-8, v4-32, v5litepod-16 (v5e-16), v5p-8, v6e-16"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    chip: Chip
    chips_per_slice: int
    num_slices: int
    topology: str  # libtpu's name, e.g. "v5e:4x4"
    devices: tuple

    @property
    def chips(self) -> int:
        return self.chips_per_slice * self.num_slices


def torus_shape(chips: int, dims: int) -> tuple[int, ...]:
    """gcloud's slice shape for a chip count: start from one chip (2x2x1 for 3-D tori) and double the smallest
    dimension, the last of equals first (v4-32: 2x2x4, v4-64: 2x4x4; v5e-8: 2x4, v5e-16: 4x4, v5e-32: 4x8)."""
    shape = [1] * dims
    if dims == 3 and chips >= 4:
        shape = [2, 2, 1]
    while _product(shape) < chips:
        smallest = min(shape)
        i = max(j for j, n in enumerate(shape) if n == smallest)
        shape[i] *= 2
    if _product(shape) != chips:
        raise ValueError(f"{chips} chips do not form a slice")
    return tuple(shape)


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _host_bounds(chip: Chip, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Chips per host: a 2x2 block (4 chips), except the single-host 1- and 8-chip v5e/v6e machines."""
    chips = _product(shape)
    if chip.torus_dims == 2 and chips in (1, 8):
        return (shape[0], shape[1], 1)
    return (min(shape[0], 2), min(shape[1], 2), 1)


def parse(name: str) -> tuple[Chip, int]:
    """`v5litepod-16` -> (the v5e chip, 16 chips)."""
    match = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise BadInput(f"--target {name!r}: not a TPU accelerator type; use gcloud's names, e.g. {EXAMPLES}.")
    chip = TPU_CHIPS[_ALIASES.get(match[1], match[1])]
    count = int(match[2])
    if count % chip.cores_in_name or count < chip.cores_in_name:
        raise BadInput(f"--target {name!r}: {match[1]} sizes count TensorCores, two per chip (e.g. {match[1]}-8).")
    chips = count // chip.cores_in_name
    try:
        torus_shape(chips, chip.torus_dims)
    except ValueError:
        raise BadInput(f"--target {name!r}: no {match[1]} slice has {chips} chips (a power of two).") from None
    return chip, chips


def resolve(name: str, num_slices: int = 1) -> Target:
    """The target's compile-only devices (libtpu's topology description)."""
    chip, chips = parse(name)
    if num_slices < 1:
        raise BadInput(f"--num_slices {num_slices}: at least 1.")
    shape = torus_shape(chips, chip.torus_dims)
    topology = f"{chip.topology_prefix}:{'x'.join(map(str, shape))}"
    try:
        import libtpu  # noqa: F401  (jax finds the compiler through it)
    except ImportError:
        raise BadInput(
            f"--target {name}: compiling for a TPU needs libtpu: pip install \"jax[tpu]==$(python -c 'import jax; "
            "print(jax.__version__)')\" (compile-only; no TPU is used)."
        ) from None
    from jax.experimental import topologies

    with _offline_libtpu(name):
        description = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chip_config_name=chip.chip_config,
            chips_per_host_bounds=_host_bounds(chip, shape),
            num_slices=num_slices,
        )
    return Target(name, chip, chips, num_slices, topology, tuple(description.devices))


def compile_here_on_cpu() -> None:
    """Cross-compiling needs no local accelerator: keep JAX on the CPU (unless the platform is already chosen
    or in use), so an installed libtpu does not try to bring up a TPU that is not here."""
    import jax
    from jax._src import xla_bridge

    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def _offline_libtpu(name: str):
    """Off a TPU VM libtpu asks the metadata server for the machine's accelerator type and hosts, and prints
    pages of warnings when there is none; a compile-only topology needs neither, so say them (when unset). It
    also locks /tmp/libtpu_lockfile for one process, which compiling does not need either (a training run or
    another check may hold it)."""
    defaults = {"TPU_ACCELERATOR_TYPE": name, "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    added = [key for key in defaults if key not in os.environ]
    os.environ.update({key: defaults[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
