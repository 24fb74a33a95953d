"""Resuming a transformers.Trainer (torch) `checkpoint-N`, so the run continues as torch's resume would.

HF's checkpoint holds the weights (model.safetensors, read without torch), `trainer_state.json` (HF's own
TrainerState), and torch pickles: `optimizer.pt` (AdamW's per-parameter `exp_avg` / `exp_avg_sq` / `step` and
the param groups' hyperparameters), `scheduler.pt` (LambdaLR's base rates and step) and `rng_state.pth` (python's,
numpy's and torch's generators). Reading the pickles needs torch. The optimizer's state is keyed by position:
HF's create_optimizer puts the decayed parameters first, then the others, each in `named_parameters()` order, so
the names come from the torch model class of the checkpoint's config built on the meta device (no memory) and
HF's own `get_decay_parameter_names`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Protocol

import jax
import numpy as np
import optax

from jtrainer.core import host_rng, storage
from jtrainer.core.errors import BadInput

logger = logging.getLogger(__name__)

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
TRAINER_STATE_NAME = "trainer_state.json"
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json")
# A peft model's checkpoint holds its adapter instead (transformers.Trainer saves a PeftModel with peft's files).
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
# jtrainer's optimizers that are torch.optim.AdamW (HF's names): the ones whose moments optimizer.pt holds as is.
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused")

NEEDS_TORCH = (
    "{folder} was written by transformers.Trainer: its optimizer, scheduler and generator states (optimizer.pt, "
    "scheduler.pt, rng_state.pth) are torch pickles, and torch is not installed. Install it (pip install torch) "
    "to resume the run, or start from its weights alone: from_pretrained({folder!r}) (or --model_name_or_path) "
    "without resume_from_checkpoint."
)


class HFCheckpointError(BadInput):
    """A transformers.Trainer checkpoint that cannot be resumed as torch would resume it."""


def written_by_hf_trainer(folder: str) -> bool:
    """Whether `folder` is a transformers.Trainer checkpoint (torch's optimizer.pt / training_args.bin, no
    jtrainer train state)."""
    return not storage.isdir(storage.join(folder, "train_state")) and any(
        storage.isfile(storage.join(folder, n)) for n in (OPTIMIZER_NAME, TRAINING_ARGS_NAME)
    )


def missing_files(folder: str) -> list[str]:
    """What a torch checkpoint lacks to be resumed (HF's get_last_checkpoint takes it by name alone; jtrainer
    skips one a crash left half-written)."""
    missing = [n for n in (TRAINER_STATE_NAME, OPTIMIZER_NAME) if not storage.isfile(storage.join(folder, n))]
    if not any(storage.isfile(storage.join(folder, n)) for n in WEIGHT_NAMES + ADAPTER_NAMES):
        missing.append(WEIGHT_NAMES[0])
    return missing


@dataclasses.dataclass(frozen=True)
class TorchAdamW:
    """torch.optim.AdamW's state as HF saved it, by HF parameter name (arrays in torch's layout)."""

    step: int  # AdamW's update count
    schedule_step: int  # the scheduler's (LambdaLR's last_epoch)
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    lr: float  # the param groups' current rate: what the next update applies
    base_lr: float  # the scheduler's base rate (scheduler.pt)
    weight_decay: float  # the decayed group's
    betas: tuple[float, float]
    eps: float
    decayed: frozenset[str]  # the parameters HF decays (the first param group)


def _torch(folder: str):
    try:
        import torch
    except ImportError as error:
        raise HFCheckpointError(NEEDS_TORCH.format(folder=folder)) from error
    return torch


def _load(torch, path: str, mmap: bool = False):
    """torch.load as HF loads its checkpoint files (weights_only, numpy's types allowed); a pickle that would run
    other code is refused in one line naming the file."""
    import pickle

    from transformers.trainer_pt_utils import safe_globals

    try:
        with safe_globals():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        raise HFCheckpointError(
            f"{path} holds objects that torch's safe loading (weights_only) refuses"
            + (f" (it would call {found.group(1)})" if found else "")
            + ": transformers.Trainer does not write such files; resume from another checkpoint, or take the "
            "weights alone of one you trust (from_pretrained)."
        ) from None


def check_pickles(folder: str) -> None:
    """Every torch pickle a resume reads loads under weights_only (tensors mapped, not read): a checkpoint that
    would fail at resume is skipped by get_last_checkpoint instead."""
    if storage.is_url(folder) or not os.path.isfile(os.path.join(folder, OPTIMIZER_NAME)):
        return  # (resuming a torch checkpoint reads a local folder)
    try:
        import torch
    except ImportError:
        return  # resuming refuses it by name (NEEDS_TORCH); it is still the last checkpoint
    for name in sorted(os.listdir(folder)):
        if name in (OPTIMIZER_NAME, SCHEDULER_NAME) or (name.startswith("rng_state") and name.endswith(".pth")):
            _load(torch, os.path.join(folder, name), mmap=True)


def torch_parameter_order(torch, folder: str) -> tuple[list[str], dict[str, tuple[int, ...]], frozenset[str]]:
    """The names of optimizer.pt's parameter indices (HF's decayed group, then the rest, each in
    named_parameters order), their torch shapes and the decayed names, from the checkpoint's config on the meta
    device."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise HFCheckpointError(
            f"{folder}/config.json names no transformers model class ({architecture!r} in 'architectures'): the "
            f"order of the parameters in {OPTIMIZER_NAME} cannot be known."
        )
    with torch.device("meta"):
        model = model_class(config)
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # no self read
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    order = [n for n, _ in named if n in decayed] + [n for n, _ in named if n not in decayed]
    return order, dict(named), frozenset(n for n, _ in named if n in decayed)


def read_adamw(folder: str, layout: ModelLayout) -> TorchAdamW:
    """optimizer.pt and scheduler.pt of `folder` as a TorchAdamW; refuses anything but HF's default AdamW groups."""
    torch = _torch(folder)
    saved = _load(torch, os.path.join(folder, OPTIMIZER_NAME))
    groups, state = saved["param_groups"], saved["state"]
    first = groups[0]
    if "betas" not in first or any(g.get("amsgrad") or g.get("maximize") for g in groups):
        raise HFCheckpointError(
            f"{folder}/{OPTIMIZER_NAME} is not torch.optim.AdamW's state (amsgrad and maximize off): jtrainer resumes "
            "the moments of HF's adamw_torch optimizers only."
        )
    order, shapes, decayed = layout.parameter_order(torch, folder)
    indices = [i for g in groups for i in g["params"]]
    if len(indices) != len(order) or len(first["params"]) not in (len(decayed), len(order)):
        raise HFCheckpointError(
            f"{folder}/{OPTIMIZER_NAME} has {len(indices)} parameters in its groups, the model "
            f"{len(order)} trainable ones: the optimizer was not built by transformers.Trainer.create_optimizer "
            "for this model."
        )
    exp_avg, exp_avg_sq, steps = {}, {}, set()
    for position, index in enumerate(indices):
        name, entry = order[position], state.get(index)
        if entry is None:  # never updated (no gradient reached it): torch creates its moments as zeros then
            exp_avg[name] = exp_avg_sq[name] = np.zeros(shapes[name], np.float32)
            continue
        if set(entry) != {"step", "exp_avg", "exp_avg_sq"}:
            raise HFCheckpointError(
                f"{folder}/{OPTIMIZER_NAME}: parameter {name} has state {sorted(entry)}, not AdamW's "
                "(step, exp_avg, exp_avg_sq)."
            )
        if tuple(entry["exp_avg"].shape) != shapes[name]:
            raise HFCheckpointError(
                f"{folder}/{OPTIMIZER_NAME}: the moment at index {index} has shape {tuple(entry['exp_avg'].shape)}, "
                f"but that position is {name} of shape {shapes[name]}: the optimizer's parameter groups are not "
                "transformers.Trainer's default ones."
            )
        exp_avg[name] = entry["exp_avg"].float().numpy()
        exp_avg_sq[name] = entry["exp_avg_sq"].float().numpy()
        steps.add(int(entry["step"]))
    if len(steps) > 1:
        raise HFCheckpointError(
            f"{folder}/{OPTIMIZER_NAME}: its parameters were updated different numbers of "
            f"times ({sorted(steps)}); jtrainer's AdamW keeps one count."
        )
    scheduler_path = os.path.join(folder, SCHEDULER_NAME)
    scheduler = _load(torch, scheduler_path) if os.path.isfile(scheduler_path) else {}
    step = steps.pop() if steps else 0
    base_lr = (scheduler.get("base_lrs") or [first.get("initial_lr", first["lr"])])[0]
    return TorchAdamW(
        step=step,
        schedule_step=int(scheduler.get("last_epoch", step)),
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        lr=float(first["lr"]),
        base_lr=float(base_lr),
        weight_decay=float(first["weight_decay"]),
        betas=(float(first["betas"][0]), float(first["betas"][1])),
        eps=float(first["eps"]),
        decayed=decayed,
    )


def read_rng_state(folder: str, process_index: int, process_count: int) -> host_rng.HostRngState | None:
    """rng_state.pth (rng_state_{i}.pth with many processes) as the host generators' state, as HF's
    _load_rng_state restores it; None (logged as HF does) when the file is absent."""
    name = f"rng_state_{process_index}.pth" if process_count > 1 else "rng_state.pth"
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        logger.info("Didn't find an RNG file (%s): reproducibility of a random collator is not guaranteed.", name)
        return None
    torch = _torch(folder)
    saved = _load(torch, path)
    cpu = saved.get("cpu")
    return host_rng.HostRngState(
        python=saved["python"],
        numpy=saved["numpy"],
        torch=None if cpu is None else bytes(cpu.numpy().tobytes()),
    )


def _moment_tree(layout: ModelLayout, params_like, moments: dict[str, np.ndarray], kind: str, folder: str):
    """A tree like the parameters holding torch's moments in jtrainer's layout (`layout.moment`), each placed on
    the sharding of the fresh moment it replaces."""

    def one(tree_path, fresh):
        label = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in tree_path)
        missing = [name for name in layout.torch_names(tree_path) if name not in moments]
        if missing:
            raise HFCheckpointError(
                f"{folder}/{OPTIMIZER_NAME} has no {kind} for {missing[0]} (parameter {label}): the checkpoint is "
                "not of this model."
            )
        value = layout.moment(tree_path, moments)
        if value.shape != fresh.shape:
            raise HFCheckpointError(
                f"{folder}/{OPTIMIZER_NAME}: the {kind} of parameter {label} has shape {value.shape} here, the "
                f"parameter {fresh.shape}."
            )
        value = np.ascontiguousarray(value, dtype=fresh.dtype)
        return jax.make_array_from_callback(fresh.shape, fresh.sharding, lambda index: value[index])

    return jax.tree_util.tree_map_with_path(one, params_like)


def adamw_state_from_torch(opt_state, layout: ModelLayout, params_like, saved: TorchAdamW, folder: str):
    """The optimizer state `opt_state` (fresh, jtrainer's AdamW) holding torch's moments and update count."""
    found = []

    def replace(node):
        if not isinstance(node, optax.ScaleByAdamState):
            return node
        found.append(node)
        return node._replace(
            count=jax.device_put(np.asarray(saved.step, node.count.dtype), node.count.sharding),
            mu=_moment_tree(layout, params_like, saved.exp_avg, "exp_avg", folder),
            nu=_moment_tree(layout, params_like, saved.exp_avg_sq, "exp_avg_sq", folder),
        )

    opt_state = jax.tree.map(replace, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if len(found) != 1:
        raise HFCheckpointError(
            f"Resuming {folder}: the optimizer's state has {len(found)} AdamW states, expected one."
        )
    return opt_state


class ModelLayout(Protocol):
    """How a checkpoint's torch names meet the model the Trainer trains (jtrainer's own, or a torch model
    through the bridge: `jtrainer.bridge.resume`)."""

    def parameter_order(self, torch, folder: str) -> tuple[list[str], dict[str, tuple[int, ...]], frozenset[str]]:
        """optimizer.pt's parameter names by index (HF's decayed group first), their shapes and the decayed ones."""

    def torch_names(self, tree_path) -> list[str]:
        """The torch names a parameter of the train state (its tree path) is made of."""

    def moment(self, tree_path, moments: dict[str, np.ndarray]) -> np.ndarray:
        """A parameter's moment in jtrainer's layout, from torch's moments by name."""

    def decayed(self, decay_mask) -> frozenset[str]:
        """jtrainer's decay mask (a tree of bools like the parameters) as torch names."""

    def load_weights(self, folder: str, mesh, rules) -> None:
        """The checkpoint's weights into the model (a fresh train state then starts from them)."""


class NativeLayout:
    """jtrainer's own model: HF names and layouts through `jtrainer.models.hf_io`; the checkpoint's model class
    (its config.json, built on the meta device) gives optimizer.pt's order."""

    def __init__(self, model):
        self.model = model

    def parameter_order(self, torch, folder):
        return torch_parameter_order(torch, folder)

    def torch_names(self, tree_path):
        from jtrainer.models import hf_io

        return [name for name, _ in hf_io.hf_names(self.model, hf_io.param_path(tree_path))]

    def moment(self, tree_path, moments):
        from jtrainer.models import hf_io

        return hf_io.param_from_hf(self.model, hf_io.param_path(tree_path), moments)

    def decayed(self, decay_mask):
        names = set()
        for tree_path, decays in jax.tree_util.tree_flatten_with_path(decay_mask)[0]:
            if decays:
                names.update(self.torch_names(tree_path))
        return frozenset(names)

    def load_weights(self, folder, mesh, rules):
        from jtrainer.models import hf_io

        hf_io.load_weights(self.model, folder, mesh=mesh, rules=rules)


def restore(folder: str, *, args, layout: ModelLayout, mesh, rules, decay_mask, fresh, max_steps_saved: int):
    """HF's _load_from_checkpoint, _load_optimizer_and_scheduler and _load_rng_state for a transformers.Trainer
    `folder`: the model's weights are loaded (placed on `mesh`), and the fresh train state `fresh()` takes torch's
    AdamW moments and count, the saved param groups' hyperparameters (as torch loads them) and the scheduler's
    base rate and step. Returns the train state and the saved host generators (or None).

    The first resumed update applies the rate saved in the param groups; jtrainer reproduces it with the saved
    run's schedule (this run's `lr_scheduler_type` and warmup over the saved `max_steps`) and refuses when that
    does not give the saved rate. Anything else that cannot continue as torch would is refused by name.
    """
    from jtrainer.numerics import opt_state as opt_states
    from jtrainer.numerics import schedules

    with storage.local_folder(folder) as local:
        missing = missing_files(local)
        if missing:
            raise HFCheckpointError(f"{folder} (a transformers.Trainer checkpoint) lacks {', '.join(missing)}.")
        saved = read_adamw(local, layout)
        ours = layout.decayed(decay_mask)
        if ours != saved.decayed:
            differ = sorted(ours ^ saved.decayed)
            raise HFCheckpointError(
                f"{folder}: the parameters jtrainer decays differ from the checkpoint's decayed group "
                f"({', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}): the model is not the checkpoint's."
            )
        layout.load_weights(local, mesh, rules)
        rng = read_rng_state(local, args.process_index, jax.process_count())
    state = fresh()
    opt_state = adamw_state_from_torch(state.opt_state, layout, state.params, saved, folder)
    warmup = args.get_warmup_steps(max_steps_saved)
    values = {
        "weight_decay": saved.weight_decay,
        "b1": saved.betas[0],
        "b2": saved.betas[1],
        "eps": saved.eps,
        "base_learning_rate": saved.base_lr,
        "warmup_steps": warmup,
        "total_steps": max_steps_saved,
        **schedules.schedule_switch(warmup, max_steps_saved),  # the saved shape throughout (a resume may switch)
    }
    for name, value in values.items():
        opt_state = opt_states.set_hyperparam(opt_state, name, value)
    opt_state = opt_states.set_schedule_count(opt_state, saved.schedule_step)
    first_rate = schedules.host_learning_rate(
        args.lr_scheduler_type, saved.base_lr, saved.schedule_step, warmup, max_steps_saved, args.lr_scheduler_kwargs
    )
    if not np.isclose(first_rate, saved.lr, rtol=1e-9, atol=1e-15):
        schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        raise HFCheckpointError(
            f"{folder}: its optimizer's next rate is {saved.lr!r}, but lr_scheduler_type={schedule} "
            f"with warmup_steps={args.warmup_steps} over its max_steps={max_steps_saved} gives {first_rate!r} at "
            f"step {saved.schedule_step}: resume with the schedule arguments the checkpoint was trained with."
        )
    step = jax.device_put(np.asarray(saved.schedule_step, state.step.dtype), state.step.sharding)
    return state.replace(step=step, opt_state=opt_state), rng
