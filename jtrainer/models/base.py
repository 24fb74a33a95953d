"""What every jtrainer model shares: an HF config held statically, and HF-format from_config / save / load."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtrainer.models import remat
from jtrainer.models.kernels.dense import dense
from jtrainer.runtime import startup


def call_block(owner, block, *args):
    """Run one block; under `owner.gradient_checkpointing`, rematerialised with `owner.remat_policy`."""
    if not getattr(owner, "gradient_checkpointing", False):
        return block(*args)
    return nnx.remat(lambda b, *a: b(*a), policy=remat.policy(owner.remat_policy))(block, *args)


def count_parameters(module: Any, exclude_embeddings: bool = False) -> int:
    """Elements of every nnx.Param of `module` (abstract ones too); without embedding tables if asked."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if not (exclude_embeddings and path[-1] == "embedding"):
            total += math.prod(var[...].shape)
    return total


class Embed(nnx.Embed):
    """nnx.Embed that adds HF's NEFTune noise to its output in training steps, once `neftune_noise_alpha` is set
    (the Trainer sets it from `TrainingArguments.neftune_noise_alpha`): uniform noise in [-m, m] with
    m = alpha / sqrt(length * features), as HF's `neftune_post_forward_hook`.

    The noise key is the train step's (see `step.apply_model`), so evaluation and generation, which pass none,
    are noise-free, and the noise is a function of (seed, step, micro-batch) like every other randomness.
    """

    def __init__(self, *args, dtype=None, **kwargs):
        super().__init__(*args, dtype=dtype, **kwargs)
        # nnx.Embed fixes an unset dtype to the table's at construction (float32), which would lift every
        # activation downstream to float32 after the step casts the parameters to bfloat16 (`bf16=True`):
        # unset, the output takes the table's dtype at call time.
        self.dtype = dtype
        self.neftune_noise_alpha: float | None = None

    def __call__(self, inputs, out_sharding=None):
        out = super().__call__(inputs, out_sharding=out_sharding)
        key = getattr(self, "_neftune_key", None)
        if self.neftune_noise_alpha is None or key is None:
            return out
        magnitude = self.neftune_noise_alpha / math.sqrt(out.shape[1] * out.shape[2])
        noise = jax.random.uniform(key, out.shape, jnp.float32, -magnitude, magnitude)
        return out + noise.astype(out.dtype)

    @property
    def weight(self) -> jax.Array:
        """The [vocab, dim] table, under torch's name (`model.get_input_embeddings().weight.shape[0]`)."""
        return self.embedding[...]

    def attend(self, query, out_sharding=None):
        """Logits of a tied LM head, query @ embedding^T, through `linear.dense` (a GEMM-speed weight gradient on
        CPU)."""
        if out_sharding is not None:
            return super().attend(query, out_sharding=out_sharding)
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return dense(query, embedding.T)


def set_neftune(model, alpha: float | None) -> None:
    """Turn NEFTune noise on (alpha) or off (None) on the model's input embeddings."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embed, Embed):
        raise ValueError(
            "neftune_noise_alpha needs a model whose get_input_embeddings() returns a jtrainer.models.base.Embed "
            f"(every jtrainer model does); {type(model).__name__} does not."
        )
    embed.neftune_noise_alpha = None if alpha is None else float(alpha)


class StaticConfig:
    """Holds an HF config as a static, hashable attribute of an nnx module.

    Equal by content (the config's JSON when the model was built), so two models built from equal configs have
    equal graph definitions and share compiled steps (a hyperparameter search's model_init builds a new one each
    trial).
    """

    def __init__(self, config):
        self.config = config
        self._key = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else id(config)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, StaticConfig) and other._key == self._key


class PretrainedMixin:
    """`config`, `from_config`, `save_pretrained` and `from_pretrained` in HF's format (see hf_io). Mixed into
    jtrainer's nnx.Module families, whose constructors take (config, *, rngs)."""

    config_class: Any  # the transformers config class of the family
    _config: StaticConfig

    if TYPE_CHECKING:  # what the families define (nnx.Module and the family's own class)

        def __init__(self, config: Any, *args: Any, rngs: nnx.Rngs, **kwargs: Any) -> None: ...

        def get_input_embeddings(self) -> Any: ...

    main_input_name = "input_ids"
    # Whether the vocabulary logits are computed with the input embedding table (a tied LM head): that product's
    # FLOPs are then not counted by the non-embedding parameters (see `throughput.flops_per_token`).
    logits_use_input_embeddings = False
    generates = False  # causal and seq2seq LMs: generation_config.json is saved beside config.json

    @property
    def config(self):
        return self._config.config

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """HF's count of parameters (every nnx.Param is trainable)."""
        return count_parameters(self, exclude_embeddings)

    def parameters(self) -> Iterator["ParameterView"]:
        """Every parameter once (a tied head has none of its own), as torch's `model.parameters()` is counted:
        `sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())`."""
        for _, var in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            yield ParameterView(var)

    def can_generate(self) -> bool:
        """HF's: whether `generate` applies (causal and seq2seq LMs)."""
        return self.generates

    @property
    def generation_config(self):
        """HF's GenerationConfig of the model (from its config, as transformers builds it); changes persist."""
        if self not in _GENERATION_CONFIGS:
            from transformers import GenerationConfig

            _GENERATION_CONFIGS[self] = GenerationConfig.from_model_config(self.config)
        return _GENERATION_CONFIGS[self]

    @generation_config.setter
    def generation_config(self, value) -> None:
        _GENERATION_CONFIGS[self] = value

    def get_output_embeddings(self):
        """The LM head with torch's `.weight` [vocab, dim]: the input embeddings when tied, None without one."""
        head = getattr(self, "lm_head", None)
        if head is not None:
            return OutputEmbeddings(head)
        if self.logits_use_input_embeddings:
            return self.get_input_embeddings()
        return None

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ):
        """HF's resize_token_embeddings: every vocabulary-sized parameter (input table, untied head, its bias)
        grows or shrinks to `new_num_tokens` (rounded up to `pad_to_multiple_of`); tied heads stay tied; the
        config's vocab_size follows. New rows are the mean of the old ones (HF's mean_resizing draws them from a
        normal around that mean with 1e-9 times their covariance; mean_resizing=False: HF's normal(0, initializer
        range) init). Returns the input embeddings."""
        embed = self.get_input_embeddings()
        old = int(embed.embedding[...].shape[0])
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embed
        new = old if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of is not None:
            new = -(-new // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
        if new == old:
            return embed
        std = float(getattr(self.config, "initializer_range", 0.02))
        for _, var in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            axes = tuple(var.get_metadata().get("logical_axes") or ())
            if "vocab" in axes and var[...].shape[axes.index("vocab")] == old:
                var.set_value(_resized(var[...], axes.index("vocab"), new, mean_resizing, std))
        for _, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Embed) and node.num_embeddings == old:
                node.num_embeddings = new
            elif isinstance(node, nnx.Linear) and node.out_features == old:
                node.out_features = new
        self.config.vocab_size = new
        self._config = StaticConfig(self.config)  # a new key: compiled steps of the old size are not shared
        return embed

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """Remat each block; `{"policy": NAME}` picks what it keeps (`jtrainer.models.remat`; default `full`)."""
        policy = (gradient_checkpointing_kwargs or {}).get("policy")
        remat.check(policy, getattr(self, "names_activations", False))
        for _, node in nnx.iter_graph(self):
            if isinstance(node, nnx.Module) and hasattr(node, "gradient_checkpointing"):
                node.gradient_checkpointing = True
                setattr(node, "remat_policy", policy)  # each family's blocks read it

    @classmethod
    def from_config(cls, config, *, seed: int = 0, dtype=None, torch_dtype=None, **kwargs):
        """A freshly initialised model of `config`, as HF's from_config (its keywords: `dtype` casts the
        parameters; `trust_remote_code` and `attn_implementation` as in from_pretrained)."""
        from jtrainer.models import loading

        startup.initialize()  # before the first device is touched (a multi-host job joins here if not yet)
        loading.refuse_inapplicable(kwargs, config)
        _, kwargs = loading.split_keywords(kwargs)
        model = cls(config, rngs=nnx.Rngs(seed), **kwargs)
        target = loading.weight_dtype(dtype if dtype is not None else torch_dtype, config)
        if target is not None:
            _cast_parameters(model, target)
        return model

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        from jtrainer.models import hf_io

        hf_io.save_pretrained(self, save_directory, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *model_args,
        config=None,
        dtype=None,
        torch_dtype=None,
        mesh=None,
        logical_axis_rules=None,
        ignore_mismatched_sizes: bool = False,
        seed: int = 0,
        **kwargs,
    ):
        """transformers' from_pretrained: a folder of config.json + safetensors as PyTorch transformers writes
        it, a gs:// / s3:// URL, or a Hub id (through huggingface_hub's cache; `cache_dir`, `revision`, `token`,
        `local_files_only`, `subfolder` as HF's). `config=` replaces config.json; keywords naming config
        attributes override it. Weights the folder lacks (another head, a base model) are initialised (from
        `seed`) and reported, as are unused ones; another shape is an error unless `ignore_mismatched_sizes`.

        The model is built abstractly (no random weights are allocated), then every parameter is read from
        disk; with `mesh`, straight onto its sharding, slice by slice. `dtype` ("auto", a name, a torch or jax
        dtype) casts them; unset, they stay float32 master weights.
        """
        from jtrainer.models import hf_io, loading
        from jtrainer.parallel import sharding

        startup.initialize()  # before the first device is touched (a multi-host job joins here if not yet)
        asked = dict(kwargs)
        loading.refuse_inapplicable(asked)  # before any download
        hub, kwargs = loading.split_keywords(dict(kwargs))
        output_loading_info = kwargs.pop("output_loading_info", False)
        directory = loading.resolve_folder(pretrained_model_name_or_path, hub)
        if config is None:
            config = loading.read_config(directory, cls.config_class)
        loading.refuse_inapplicable(asked, config)
        config, model_kwargs = loading.config_and_model_kwargs(config, kwargs)
        build = lambda: cls(config, rngs=nnx.Rngs(seed), **model_kwargs)  # noqa: E731
        model = nnx.eval_shape(build)
        rules = sharding.merged_rules(logical_axis_rules) if mesh is not None else None
        target = loading.weight_dtype(dtype if dtype is not None else torch_dtype, config)
        report = hf_io.load_weights(
            model,
            directory,
            mesh=mesh,
            rules=rules,
            dtype=target,
            strict=False,
            fresh=build,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            source=pretrained_model_name_or_path,
        )
        config._name_or_path = pretrained_model_name_or_path
        return (model, report.to_dict()) if output_loading_info else model


_GENERATION_CONFIGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # kept off the module's graph


class ParameterView:
    """One parameter as a torch script counts it: numel(), data_ptr() (the same for a parameter shared
    twice), shape, dtype; `.data` is the array."""

    requires_grad = True

    def __init__(self, var: nnx.Variable):
        self._var = var

    @property
    def data(self) -> jax.Array:
        return self._var[...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._var[...].shape)

    @property
    def dtype(self):
        return self._var[...].dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def data_ptr(self) -> int:
        return id(self._var)


class OutputEmbeddings:
    """An untied LM head seen as torch's Linear: `.weight` is [vocab, dim] (the kernel transposed)."""

    def __init__(self, head: Any):  # an nnx.Linear (or the bridge's Dense)
        self.module = head

    @property
    def weight(self) -> jax.Array:
        return self.module.kernel[...].T

    @property
    def bias(self) -> jax.Array | None:
        bias = getattr(self.module, "bias", None)
        return None if bias is None else bias[...]


def _resized(value: jax.Array, axis: int, new: int, mean_resizing: bool, std: float) -> jax.Array:
    """`value` cut or extended to `new` entries along `axis`; new entries the mean of the old (or HF's init)."""
    old = value.shape[axis]
    if new < old:
        return jax.lax.slice_in_dim(value, 0, new, axis=axis)
    shape = list(value.shape)
    shape[axis] = new - old
    if mean_resizing:
        added = jnp.broadcast_to(jnp.mean(value.astype(jnp.float32), axis=axis, keepdims=True), shape)
    elif value.ndim == 1:
        added = jnp.zeros(shape)
    else:
        added = std * jax.random.normal(jax.random.key(0), shape)
    return jnp.concatenate([value, added.astype(value.dtype)], axis=axis)


def _cast_parameters(model: Any, dtype) -> None:
    """Every floating-point parameter of `model` in `dtype`, in place."""
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var[...]
        if jnp.issubdtype(value.dtype, jnp.floating):
            var.set_value(value.astype(dtype))
