"""TrainingArguments: transformers' front end, with a JAX meaning behind every field.

The class subclasses `transformers.TrainingArguments`, so every field name, default, help text, `set_*`
builder, `to_dict` and `HfArgumentParser` support are HF's own. What changes is what needs torch: the
post-init (device set-up, accelerate, TF32, DeepSpeed) and the process/device properties, which here come
from JAX. Fields with no JAX meaning are accepted and warned about once, by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import transformers
from transformers.debug_utils import DebugOption
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, _convert_str_dict

from jtrainer.core import env, storage
from jtrainer.runtime import startup

logger = logging.getLogger(__name__)


# Fields whose setting has no JAX counterpart: accepted (so HF scripts run unchanged), warned about once when
# they differ from HF's default, and never allowed to change results. Value: why nothing happens.
IGNORED_FIELDS: dict[str, str] = {
    "tf32": "XLA chooses matmul precision itself (see jax_default_matmul_precision)",
    "torch_empty_cache_steps": "XLA manages device memory; there is no cache to empty",
    "log_on_each_node": "only process 0 logs",
    "eval_use_gather_object": "predictions are gathered as global jax.Arrays",
    "hub_always_push": "every committed checkpoint is pushed (uploads run in the background, in order)",
    "use_cpu": "set JAX_PLATFORMS=cpu to run on CPU",
    "accelerator_config": "there is no accelerate in jtrainer",
    "dataloader_num_workers": "batches are built by one background prefetch thread",
    "dataloader_pin_memory": "host-to-device copies are done by jax.device_put",
    "dataloader_persistent_workers": "batches are built by one background prefetch thread",
    "dataloader_prefetch_factor": "batches are built by one background prefetch thread",
    "dataloader_multiprocessing_context": "batches are built by one background prefetch thread",
    "ddp_find_unused_parameters": "there is no DDP: one jit-compiled step over a mesh",
    "ddp_bucket_cap_mb": "there is no DDP: one jit-compiled step over a mesh",
    "ddp_broadcast_buffers": "there is no DDP: one jit-compiled step over a mesh",
    "ddp_static_graph": "there is no DDP: one jit-compiled step over a mesh",
    "ddp_backend": "collectives are XLA's",
    "ddp_timeout": "collectives are XLA's",
    "fsdp_config": "torch FSDP options; with fsdp set, parameters are split over the mesh's fsdp axis",
    "deepspeed": "there is no DeepSpeed: one jit-compiled step over a mesh",
    "debug": "torch debug options have no XLA counterpart",
    "optim_target_modules": "GaLore/APOLLO target modules are torch-only",
    "torch_compile_backend": "the step is always compiled by XLA",
    "torch_compile_mode": "the step is always compiled by XLA",
    "resume_from_checkpoint": "pass resume_from_checkpoint to Trainer.train(), as HF's own scripts do",
    "local_rank": "process ids come from jax.distributed",
    "use_cache": "the KV cache only matters for generation",
    "save_on_each_node": "process 0 writes the JSON files; every process writes its own array shards",
}


# Fields honoured through a JAX mechanism rather than the torch one HF uses (none of them is in IGNORED_FIELDS).
EMULATED_FIELDS: dict[str, str] = {
    "fsdp": "parameters and optimizer state split over the mesh's fsdp axis (GSPMD)",
    "parallelism_config": "mapped onto the mesh's data/fsdp/tensor/sequence axes (expert: mesh_shape)",
    "gradient_checkpointing": "jax.checkpoint (remat) around every block",
    "gradient_checkpointing_kwargs": "remat policy: full, save_dots_except_mlp, offload_dots_except_mlp or jax's",
    "activation_checkpointing": "jax.checkpoint (remat) around every block",
    "activation_checkpointing_kwargs": "remat policy: full, save_dots_except_mlp, offload_dots_except_mlp or jax's",
    "bf16": "compute in bfloat16, float32 master weights and optimizer state",
    "bf16_full_eval": "evaluation in bfloat16",
    "fp16": "compute in float16 with dynamic loss scaling (torch's GradScaler), float32 master weights",
    "fp16_full_eval": "evaluation in float16",
    "optim": "the optax equivalent of the torch optimizer",
    "torch_compile": "the step is always compiled by XLA",
    "gradient_accumulation_steps": "a scan over micro-batches inside one compiled step",
    "auto_find_batch_size": "XLA out-of-memory or the compiled step's memory analysis; effective batch kept",
    "use_liger_kernel": "as Liger's patched forward: no logits in any training call (chunking is the default)",
    "liger_kernel_config": "fused_linear_cross_entropy: the chunked loss; the other kernels are XLA's fusions",
}


def field_treatment(name: str) -> tuple[str, str]:
    """How jtrainer treats a TrainingArguments field: ("ignored", why), ("emulated", how) or ("honoured", "")."""
    if name in IGNORED_FIELDS:
        return "ignored", IGNORED_FIELDS[name]
    if name in EMULATED_FIELDS:
        return "emulated", EMULATED_FIELDS[name]
    return "honoured", ""


# liger_kernel_config's keys (Liger's apply_liger_kernel_to_* options). Only fused_linear_cross_entropy changes
# what XLA computes; RoPE, SwiGLU, RMSNorm and LayerNorm are fused by XLA already.
LIGER_KERNELS = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu", "layer_norm", "geglu")


@dataclass(repr=False)
class TrainingArguments(transformers.TrainingArguments):
    """HF's TrainingArguments, with a JAX engine behind them.

    JAX-only fields are grouped at the end; everything else is HF's field of the same name.
    """

    if TYPE_CHECKING:  # for type checkers only (the dataclass keeps HF's field): HF's __post_init__ sets it
        output_dir: str = "trainer_output"

    # --- JAX-only fields ---
    jax_compilation_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory of JAX's persistent compilation cache (a second identical run loads its compiled "
            "steps instead of compiling). Unset: $JTRAINER_COMPILATION_CACHE_DIR, else "
            "~/.cache/jtrainer/jax_compilation_cache. 'none' turns it off."
        },
    )
    default_bf16: bool = field(
        default=True,
        metadata={
            "help": "When neither bf16 nor fp16 is set: compute in bfloat16 (fp32 master weights) on TPUs and on "
            "GPUs with bfloat16 (compute capability >= 8.0), fp32 on CPUs. False keeps HF's fp32 default."
        },
    )
    log_throughput: bool = field(
        default=False,
        metadata={
            "help": "Add train_tokens_per_second and, on accelerators with a known peak, train_mfu (model FLOPs "
            "utilisation) to every training log (off: log_history has exactly HF's keys; on in jtrainer's configs)."
        },
    )
    mesh_shape: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Device mesh axis sizes, e.g. {"data": 2, "fsdp": -1, "tensor": 2} (-1: the remaining devices). '
            "Axes: data, fsdp, expert, tensor, sequence. Unset: from parallelism_config or fsdp, else all devices "
            "on data."
        },
    )
    logical_axis_rules: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Overrides of the logical-axis -> mesh-axis table, e.g. {"mlp": "fsdp", "vocab": null}. '
            "See jtrainer.parallel.sharding.DEFAULT_RULES."
        },
    )
    nan_inf_policy: str = field(
        default="log",
        metadata={
            "help": "What a non-finite loss or update does: 'log' (HF's behaviour: logged, and "
            "logging_nan_inf_filter affects logs only), 'skip' (the update is skipped, counted as "
            "skipped_updates in the logs), 'error' (training stops with an error naming the step).",
            "choices": ["log", "skip", "error"],
        },
    )
    async_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Write checkpoints in the background: training continues while orbax writes, and a committer "
            "thread commits each checkpoint (checkpoint-N appears) as soon as its last byte is written."
        },
    )
    prefetch_batches: int = field(
        default=2,
        metadata={"help": "How many batches a background thread prepares (and places on devices) ahead of the step."},
    )

    loss_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Sequence positions per chunk of the causal-LM loss, computed without whole [tokens, vocab] "
            "logits wherever nothing else reads them (one chunk's logits exist at a time, recomputed in the backward "
            "pass; rows no longer than this are one chunk). 0: whole logits."
        },
    )

    def __post_init__(self):
        startup.initialize()  # where HF's TrainingArguments sets up its distributed state
        self._normalise()
        self._validate()
        self.mixed_precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        # The step is always compiled; keep HF's invariant that a backend implies compilation.
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        self.deepspeed_plugin = None
        self.distributed_state = None
        warn_ignored_fields(self)
        if self.use_cpu:  # HF's side effect (after the warning: pinning is the user's field, not theirs here)
            self.dataloader_pin_memory = False

    def chunked_loss_positions(self) -> int | None:
        """Positions per chunk of the causal-LM loss where only the loss reads the logits, or None for whole
        logits (`loss_chunk_size` 0, or use_liger_kernel with liger_kernel_config's fused_linear_cross_entropy
        off: HF then computes whole logits)."""
        kernels = self.liger_kernel_config or {}
        liger_off = self.use_liger_kernel and not kernels.get("fused_linear_cross_entropy", True)
        return None if liger_off or self.loss_chunk_size == 0 else self.loss_chunk_size

    def compute_dtype(self, training: bool = True):
        """The dtype steps compute in, parameters cast from their fp32 masters (None: fp32). Evaluation follows
        training unless `fp16_full_eval` / `bf16_full_eval` asks for a half precision of its own."""
        if not training and self.fp16_full_eval:
            return jnp.float16
        if not training and self.bf16_full_eval:
            return jnp.bfloat16
        if self.fp16:
            return jnp.float16
        return jnp.bfloat16 if self.compute_in_bf16() else None

    def compute_in_bf16(self) -> bool:
        """bf16 compute: asked for (`bf16`), or by `default_bf16` on hardware with bfloat16 units."""
        if self.bf16:
            return True
        if self.fp16 or not self.default_bf16:
            return False
        from jtrainer.parallel.sharding import mesh_devices

        device = mesh_devices()[0]  # the target's, when `jtrainer check --target` compiles for another machine
        if device.platform == "tpu":
            return True
        capability = getattr(device, "compute_capability", None)
        return device.platform == "gpu" and capability is not None and float(capability) >= 8.0

    def _normalise(self) -> None:
        """HF's defaults, JSON-string dicts, deprecated aliases, enums and derived values."""
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        for name in self._VALID_DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("{"):
                setattr(self, name, _convert_str_dict(json.loads(value)))
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is None and getattr(self, old) is not None:
                warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning)
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        if storage.is_url(self.output_dir) or str(self.output_dir).startswith("file://"):
            self.output_dir = storage.normalize(self.output_dir)  # gs://, s3://: kept a URL; file://: a local path
        else:
            self.output_dir = os.path.expanduser(self.output_dir)
        if self.disable_tqdm is None:
            self.disable_tqdm = transformers.logging.get_logger().getEffectiveLevel() > logging.WARN
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"

        self.eval_strategy = IntervalStrategy(self.eval_strategy)
        self.logging_strategy = IntervalStrategy(self.logging_strategy)
        self.save_strategy = SaveStrategy(self.save_strategy)
        self.hub_strategy = HubStrategy(self.hub_strategy)
        self.lr_scheduler_type = SchedulerType(self.lr_scheduler_type)
        self.optim = OptimizerNames(self.optim)
        if isinstance(self.debug, str):
            self.debug = [DebugOption(option) for option in self.debug.split()]
        elif self.debug is None:
            self.debug = []

        if self.do_eval is False and self.eval_strategy != IntervalStrategy.NO:
            self.do_eval = True
        if self.eval_strategy == IntervalStrategy.STEPS and not self.eval_steps:
            if self.logging_steps > 0:
                self.eval_steps = self.logging_steps
            else:
                raise ValueError(
                    f"evaluation strategy {self.eval_strategy} requires either non-zero --eval_steps or --logging_steps"
                )
        plateau_like = self.lr_scheduler_type in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY)
        if (self.load_best_model_at_end or plateau_like) and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.report_to in ("all", ["all"]):
            from transformers.integrations import get_available_reporting_integrations

            self.report_to = get_available_reporting_integrations()
        elif self.report_to in ("none", ["none"]):
            self.report_to = []
        elif isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if _in_kubeflow_trainjob() and "kubeflow" not in (reporters := list(self.report_to or [])):
            self.report_to = reporters + ["kubeflow"]  # HF adds it inside a Kubeflow TrainJob

    def _validate(self) -> None:
        """HF's validation rules (those that do not depend on torch), with HF's messages."""
        if self.torch_empty_cache_steps is not None and not (
            isinstance(self.torch_empty_cache_steps, int) and self.torch_empty_cache_steps > 0
        ):
            raise ValueError(
                f"`torch_empty_cache_steps` must be an integer bigger than 0, got {self.torch_empty_cache_steps}."
            )
        output_dir = str(self.output_dir)  # set by _normalise
        storage.check_output_url(output_dir)
        if self.push_to_hub and storage.is_url(output_dir):
            raise ValueError(
                f"push_to_hub uploads output_dir from this machine, which {self.output_dir!r} is not: "
                "train into a local output_dir to push to the Hub."
            )
        self._check_numbers()
        if self.learning_rate < 0:  # torch's optimizers refuse it when HF builds them; here before anything runs
            raise ValueError(f"Invalid learning rate: {self.learning_rate} (learning_rate must be >= 0).")
        if self.logging_strategy == IntervalStrategy.STEPS and self.logging_steps == 0:
            raise ValueError(f"logging strategy {self.logging_strategy} requires non-zero --logging_steps")
        for name, strategy, steps_strategy in (
            ("logging_steps", self.logging_strategy, IntervalStrategy.STEPS),
            ("eval_steps", self.eval_strategy, IntervalStrategy.STEPS),
            ("save_steps", self.save_strategy, SaveStrategy.STEPS),
        ):
            value = getattr(self, name)
            if strategy == steps_strategy and value > 1:
                if value != int(value):
                    raise ValueError(f"--{name} must be an integer if bigger than 1: {value}")
                setattr(self, name, int(value))
        if self.load_best_model_at_end and self.save_strategy != SaveStrategy.BEST:
            _check_best_model_strategies(self)
        if self.fp16 and self.bf16:
            raise ValueError("At most one of fp16 and bf16 can be True, but not both")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ValueError("At most one of fp16 and bf16 can be True for full eval, but not both")
        for scheduler in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY):
            if self.lr_scheduler_type == scheduler and self.eval_strategy == IntervalStrategy.NO:
                raise ValueError(f"lr_scheduler_type {scheduler.value} requires an eval strategy")
        if self.warmup_steps < 0:
            raise ValueError(f"Got warmup_steps = {self.warmup_steps}, Expected value warmup_steps >= 0")
        if self.dataloader_num_workers == 0 and self.dataloader_prefetch_factor is not None:
            raise ValueError(
                "--dataloader_prefetch_factor can only be set when data is loaded in a different process, i.e."
                " when --dataloader_num_workers > 0."
            )
        if self.save_strategy == SaveStrategy.BEST and self.metric_for_best_model is None:
            raise ValueError(  # HF's words (its Trainer raises them)
                "`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
                "`args.load_best_model_at_end` is set to `True`."
            )
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"--gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.nan_inf_policy not in ("log", "skip", "error"):
            raise ValueError(f"--nan_inf_policy must be 'log', 'skip' or 'error', got {self.nan_inf_policy!r}.")
        if not (isinstance(self.loss_chunk_size, int) and self.loss_chunk_size >= 0):
            raise ValueError(
                f"--loss_chunk_size must be an integer >= 0 (0: whole logits), got {self.loss_chunk_size!r}."
            )
        unknown = sorted(set(self.liger_kernel_config or {}) - set(LIGER_KERNELS))
        if unknown:
            raise ValueError(
                f"liger_kernel_config: unknown kernel {unknown[0]!r}; the keys are Liger's: {', '.join(LIGER_KERNELS)}."
            )
        if self.prefetch_batches < 0:
            raise ValueError(f"--prefetch_batches must be >= 0, got {self.prefetch_batches}.")

    def _check_numbers(self) -> None:
        """Every float field finite (a NaN learning rate or weight decay, which torch's optimizers refuse, or an
        infinite one, would train to NaN weights), max_grad_norm excepted (inf: no clipping, as torch), and the
        seeds within numpy's range (HF's set_seed seeds numpy with them)."""
        for item in dataclasses.fields(self):
            value = getattr(self, item.name, None)
            if not isinstance(value, float) or math.isfinite(value):
                continue
            if item.name == "max_grad_norm" and value == math.inf:
                continue
            raise ValueError(f"--{item.name} must be a finite number, got {value}.")
        for name in ("seed", "data_seed"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < 2**32):
                raise ValueError(
                    f"--{name} must be a whole number in [0, 2**32 - 1] (numpy's seed range), got {value}."
                )

    # --- Properties that HF answers from torch/accelerate; here from JAX. ---
    @property
    def n_gpu(self) -> int:
        """HF's count of the GPUs this process drives: its local GPUs, 0 on a CPU or TPU (as torch reports)."""

        return jax.local_device_count() if jax.default_backend() == "gpu" else 0

    @property
    def train_batch_size(self) -> int:
        """Rows per step this process feeds: HF's per-device size times its devices (all local devices here,
        as HF's DataParallel multiplies by n_gpu)."""

        return self.per_device_train_batch_size * jax.local_device_count()

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * jax.local_device_count()

    @property
    def device(self):
        return jax.local_devices()[0]

    @property
    def world_size(self) -> int:
        return jax.process_count()

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def local_process_index(self) -> int:
        """This process's index on its machine (`jtrainer launch` sets it; one process per host elsewhere)."""
        return env.LOCAL_PROCESS_ID.get_int() or 0

    @property
    def parallel_mode(self):
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def should_log(self) -> bool:
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        return self.process_index == 0

    @contextlib.contextmanager
    def main_process_first(self, local=True, desc="work"):
        yield


def _in_kubeflow_trainjob() -> bool:
    """transformers.integrations' is_kubeflow_available, read here: importing that module costs seconds."""
    if os.getenv("DISABLE_KUBEFLOW_INTEGRATION", "FALSE").upper() == "TRUE":
        return False
    return os.getenv("KUBEFLOW_TRAINER_SERVER_URL") is not None


def _check_best_model_strategies(args: Any) -> None:  # HF's field types allow None where _normalise set a number
    if args.eval_strategy != args.save_strategy:
        raise ValueError(
            "--load_best_model_at_end requires the save and eval strategy to match, except when"
            f' --save_strategy="best", but found\n- Evaluation strategy: {args.eval_strategy}\n- Save strategy:'
            f" {args.save_strategy}"
        )
    if args.eval_strategy == IntervalStrategy.STEPS and args.save_steps % args.eval_steps != 0:
        if args.eval_steps < 1 or args.save_steps < 1:
            if not (args.eval_steps < 1 and args.save_steps < 1):
                raise ValueError(
                    "--load_best_model_at_end requires the saving steps to be a multiple of the evaluation "
                    "steps, which cannot get guaranteed when mixing ratio and absolute steps for save_steps "
                    f"{args.save_steps} and eval_steps {args.eval_steps}."
                )
            scale = 1_000_000  # integer arithmetic, as HF, to avoid float remainders of ratios
            if round(args.save_steps * scale) % round(args.eval_steps * scale) != 0:
                raise ValueError(
                    "--load_best_model_at_end requires the saving steps to be a multiple of the evaluation "
                    f"steps, but found {args.save_steps}, which is not a multiple of {args.eval_steps}."
                )
        else:
            raise ValueError(
                "--load_best_model_at_end requires the saving steps to be a round multiple of the evaluation "
                f"steps, but found {args.save_steps}, which is not a round multiple of {args.eval_steps}."
            )


_warned: set[str] = set()


def honour_fields(*names: str) -> None:
    """The caller gives these IGNORED_FIELDS their HF meaning (`jtrainer train` passes resume_from_checkpoint to
    train(), as HF's scripts do): no "has no effect" warning for them."""
    _warned.update(names)


def warn_ignored_fields(args: TrainingArguments) -> list[str]:
    """Warn once per field name about fields set away from HF's default that have no JAX meaning."""
    defaults = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    flagged = []
    for name, why in IGNORED_FIELDS.items():
        spec = defaults[name]
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        value = getattr(args, name)
        if value in (None, False, [], {}, "") and default in (None, False, [], {}, ""):
            continue
        if value == default or str(value) == str(default):
            continue
        flagged.append(name)
        if name not in _warned:
            _warned.add(name)
            logger.warning("TrainingArguments.%s=%r has no effect in jtrainer: %s.", name, value, why)
    return flagged


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """HF's Seq2SeqTrainingArguments (`predict_with_generate`, `generation_max_length`, `generation_num_beams`,
    `generation_config`) on jtrainer's torch-free TrainingArguments."""

    def to_dict(self) -> dict[str, Any]:
        return transformers.Seq2SeqTrainingArguments.to_dict(self)
