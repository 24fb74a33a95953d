"""Accelerators that are not here, for `jtrainer check --target`: compile-only devices with their chip's memory
and peak rates, so a run is sized before a slice is rented.

TPU targets are libtpu's compile-only topologies (`pip install "jax[tpu]==<the jax in use>"`; nothing is run and
no TPU is contacted), named as gcloud names accelerator types: `v4-N` and `v5p-N` count TensorCores (two per
chip), `v5litepod-N` (alias `v5e-N`) and `v6e-N` count chips; `num_slices` > 1 gives a multi-slice target
whose slices are joined by the data-center network.

GPU targets are the CUDA plugin's deviceless topologies (`pip install "jax[cuda12-local]==<the jax in use>"`: the
plugin without CUDA libraries; no GPU or driver is needed to compile): `h100x8`, `h200x8`, `a100x8` name a node of
that many GPUs, `num_nodes` > 1 several such nodes. XLA does not refuse a GPU layout that overflows memory and
reports no FLOPs there, so `jtrainer check` compares the memory itself and estimates time from 6ND.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from jtrainer.core.errors import BadInput

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
class Gpu:
    """One GPU model: its memory, bandwidth and what XLA's GPU compiler needs to know of it."""

    device_kind: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    compute_capability: int  # major version: 8 Ampere, 9 Hopper
    sm_count: int
    fp32_units_per_sm: int
    clock_ghz: float
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int

    def target_config(self) -> str:
        """XLA's GpuTargetConfig (text proto) for a deviceless compile."""
        info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 49152,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "threads_per_core_limit": 2048,
            "core_count": self.sm_count,
            "fpus_per_core": self.fp32_units_per_sm,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.hbm_bytes_per_s),
            "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": self.hbm_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        fields = "\n".join(f"  {key}: {value}" for key, value in info.items())
        return (
            f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {self.compute_capability} }}\n}}\n"
            f'platform_name: "CUDA"\ndevice_description_str: "{self.device_kind}"\n'
        )


MIB = 2**20
GPUS: dict[str, Gpu] = {  # memory as nvidia-smi reports it (MiB), bandwidth and SM layout from NVIDIA's data sheets
    "h100": Gpu("NVIDIA H100 80GB HBM3", 81559 * MIB, 3.35e12, 9, 132, 128, 1.98, 50 * MIB, 228 * 1024, 227 * 1024),
    "h200": Gpu("NVIDIA H200", 143771 * MIB, 4.8e12, 9, 132, 128, 1.98, 50 * MIB, 228 * 1024, 227 * 1024),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 81920 * MIB, 2.039e12, 8, 108, 64, 1.41, 40 * MIB, 164 * 1024, 163 * 1024),
}
GPU_EXAMPLES = "h100x8, h200x8, a100x8 (GPUs per node; --num_nodes for more nodes)"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    chip: Chip | Gpu
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
        raise BadInput(
            f"--target {name!r}: not a TPU accelerator type or GPU node; use gcloud's names, e.g. "
            f"{EXAMPLES}, or {GPU_EXAMPLES}."
        )
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


def parse_gpu(name: str) -> tuple[Gpu, int] | None:
    """`h100x8` -> (the H100, 8 GPUs per node); None when `name` is no GPU target."""
    match = re.fullmatch(r"(h100|h200|a100)x(\d+)", name.strip().lower())
    if not match:
        return None
    per_node = int(match[2])
    if not 1 <= per_node <= 8:
        raise BadInput(f"--target {name!r}: a node holds 1 to 8 GPUs ({match[1]}x8); add nodes with --num_nodes.")
    return GPUS[match[1]], per_node


def resolve(name: str, num_slices: int = 1, num_nodes: int = 1) -> Target:
    """The target's compile-only devices (libtpu's topology description, or the CUDA plugin's for GPUs)."""
    gpu = parse_gpu(name)
    if gpu is not None:
        if num_slices != 1:
            raise BadInput(f"--num_slices {num_slices}: for TPU slices; GPU targets take --num_nodes.")
        return _resolve_gpu(name, *gpu, num_nodes)
    if num_nodes != 1:
        raise BadInput(f"--num_nodes {num_nodes}: for GPU targets ({GPU_EXAMPLES}); TPU slices take --num_slices.")
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


def _resolve_gpu(name: str, gpu: Gpu, per_node: int, num_nodes: int) -> Target:
    if num_nodes < 1:
        raise BadInput(f"--num_nodes {num_nodes}: at least 1.")
    import importlib.util

    import jax

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise BadInput(
            f'--target {name}: compiling for a GPU needs the CUDA plugin: pip install "jax[cuda12-local]=='
            f'{jax.__version__}" (the plugin without CUDA libraries; no GPU is used).'
        )
    from jax.experimental import topologies

    topology = f"1x{num_nodes}x{per_node}"  # slices x nodes x GPUs per node
    description = topologies.get_topology_desc(name, "cuda", target_config=gpu.target_config(), topology=topology)
    return Target(name, gpu, per_node * num_nodes, 1, topology, tuple(description.devices))


def compile_here_on_cpu() -> None:
    """Cross-compiling needs no local accelerator: keep JAX on the CPU (unless the platform is already chosen
    or in use), so an installed libtpu does not try to bring up a TPU that is not here."""
    import jax
    from jax._src import xla_bridge

    if not getattr(jax.config, "jax_platforms") and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def _offline_libtpu(name: str):
    """Off a TPU VM libtpu asks the metadata server for the machine's accelerator type and hosts, and prints
    pages of warnings when there is none; a compile-only topology needs neither, so say them (when unset). It
    also locks /tmp/libtpu_lockfile for one process, which compiling does not need either (a training run or
    another check may hold it)."""
    defaults = {
        "TPU_ACCELERATOR_TYPE": name,
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "1",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    added = [key for key in defaults if key not in os.environ]
    os.environ.update({key: defaults[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
