"""A transformers PyTorch model as an nnx module: its weights as JAX arrays keyed by HF's names, its forward
transformers' own code, run on those arrays through torchax.

The Trainer's step knows no difference from a native model (DESIGN.md, decision 13): `TorchModel` splits into a
static graph definition (which holds the torch model, used only for its code) and a state pytree: trainable
parameters (`nnx.Param`), frozen parameters and buffers (non-persistent ones too) as model state, and the key of
torch's random ops (dropout), which the train step reseeds per micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from typing import Any

import jax
import numpy as np
import torch
from flax import nnx

from jtrainer.bridge import adapters, attention, chunked_loss, custom_autograd, layout, torchax_compat, untraceable
from jtrainer.core.state import Frozen  # requires_grad=False: transformers.Trainer's optimizer never sees it
from jtrainer.models import hf_io, remat
from jtrainer.models.lm_head import ChunkedLossHead
from jtrainer.models.outputs import Outputs
from jtrainer.parallel import sharding

_NEFTUNE_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # embeddings -> NEFTune's hook handle

# torchax's environment (its random key, modes, the weights a call swaps into a module) is one per process: torch
# code traces under it one thread at a time (a batch prepared ahead in the prefetch thread may run a model's pass,
# a DPO reference's, while the main thread traces the train step).
_TRACING = threading.RLock()
_log = logging.getLogger(__name__)


class Buffer(nnx.Variable):
    """A torch buffer (rotary frequencies, position ids, BatchNorm statistics)."""


class RandomKey(nnx.Variable):
    """The key torch's random ops draw from under torchax (dropout in train mode)."""


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_array(tensor: torch.Tensor) -> jax.Array | jax.ShapeDtypeStruct:
    """A torch CPU tensor as a jax array of the same dtype (bfloat16 included); a meta tensor (a model built on
    torch's meta device) as its shape and dtype only."""
    if tensor.is_meta:
        torchax_compat.environment()  # torchax is imported there, with its fixes
        from torchax.ops import mappings

        return jax.ShapeDtypeStruct(tuple(tensor.shape), mappings.t2j_dtype(tensor.dtype))
    return torchax_compat.environment().t2j_copy(tensor.detach())


def to_tensor(array) -> torch.Tensor:
    """A jax array as a torch CPU tensor of the same dtype (bfloat16 through its bits: numpy has none). An array
    spread over several processes is gathered onto each of them as the native export gathers (`hf_io.host_value`:
    in row blocks, so no device holds a whole replica of a large tensor; a collective: every process calls it),
    into one host copy."""
    host = hf_io.host_value(array)
    assert host is not None  # kept
    if not host.flags.writeable:  # a view of the device buffer (torch.from_numpy needs its own)
        host = host.copy()
    if host.dtype == jax.numpy.bfloat16:
        return torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(host)


@contextlib.contextmanager
def _weights_kept(model: torch.nn.Module):
    """Every module's own parameters and buffers exactly as before the call. torch's functional_call restores
    them in the order it swapped them in, which leaves a module shared under two names (T5's `shared` is also
    `encoder.embed_tokens`) holding the call's tensors."""
    saved = [(module, dict(module._parameters), dict(module._buffers)) for module in model.modules()]
    try:
        yield
    finally:
        for module, parameters, buffers in saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """transformers' activation-checkpointing flag (`is_gradient_checkpointing` before transformers 5.23); a peft
    model's is its base model's."""
    model = adapters.inspected(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _jax_checkpoint(function, *args, policy: str | None = None):
    """transformers' `_gradient_checkpointing_func` under the bridge: the layer's call rematerialised by
    `jax.checkpoint` (its activations recomputed in the backward pass, not stored; `policy`: one of
    `jax.checkpoint_policies` by name, what to keep)."""
    from transformers.utils.output_capturing import _active_collector

    env = torchax_compat.environment()
    arrays = {i: env.t2j_iso(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    collected = _active_collector.get()  # what transformers' output hooks record (router logits, ...), or None

    # The key torch's random ops (dropout) draw from goes in and out of the rematerialised function explicitly:
    # drawn inside it, torchax's rotated key would leak the checkpoint's tracer; as an input, the recomputation
    # in the backward pass draws the same masks. What transformers' output hooks record inside the layer (an MoE
    # router's logits) comes out the same way, then joins the outer record: kept there, it would leak too.
    def layer(arrays, key):
        outer, env.param.prng = env.param.prng, key
        inner = _fresh_record(collected)
        token = _active_collector.set(inner) if inner is not None else None
        try:
            call_args = [env.j2t_iso(arrays[i]) if i in arrays else a for i, a in enumerate(args)]
            result = function(*call_args)
            return env.t2j_iso(result), env.t2j_iso(_recorded_since(collected, inner)), env.param.prng
        finally:
            if token is not None:
                _active_collector.reset(token)
            env.param.prng = outer

    keep = remat.policy(policy)
    outputs, recorded, env.param.prng = jax.checkpoint(layer, policy=keep)(arrays, env.param.prng)
    for name, values in env.j2t_iso(recorded).items():
        collected[name].extend(values)
    return env.j2t_iso(outputs)


def _fresh_record(collected: dict | None) -> dict | None:
    """A stand-in for transformers' output record inside a rematerialised layer: each list as long as the outer
    one (its hooks read the length: which hidden states are kept), holding nothing yet."""
    if collected is None:
        return None
    return {name: [None] * len(value) if isinstance(value, list) else value for name, value in collected.items()}


def _recorded_since(collected: dict | None, inner: dict | None) -> dict[str, list]:
    """What the hooks appended inside the layer, by output name."""
    if collected is None or inner is None:
        return {}
    return {
        name: value[len(collected[name]) :]
        for name, value in inner.items()
        if isinstance(value, list) and len(value) > len(collected[name])
    }


@contextlib.contextmanager
def _rematerialised(model: torch.nn.Module, on: bool, policy: str | None):
    """Each layer transformers checkpoints (`GradientCheckpointingLayer` with `gradient_checkpointing` set)
    rematerialised with jax.checkpoint for one call; torch's own function is put back after."""
    layers: list[Any] = [m for m in model.modules() if on and getattr(m, "gradient_checkpointing", False) is True]
    saved = [(m, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    for layer in layers:
        layer._gradient_checkpointing_func = functools.partial(_jax_checkpoint, policy=policy)
    try:
        yield
    finally:
        for layer, function in saved:
            if function is None:
                layer.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                layer._gradient_checkpointing_func = function


_ACTIVATION_AXES = {2: ("batch", "length"), 3: ("batch", "length", "act_embed")}


def _constrained(value):
    """An activation [batch, length, ...] laid out as the native models lay theirs out (rows over data/fsdp,
    positions over sequence), under the Trainer's mesh and rules; anything else as it is."""
    import torchax.tensor

    if isinstance(value, (tuple, list)) and value:
        return type(value)([_constrained(value[0]), *value[1:]])
    if not isinstance(value, torchax.tensor.Tensor) or value.ndim not in _ACTIVATION_AXES:
        return value
    return value.apply_jax(sharding.constrain, _ACTIVATION_AXES[value.ndim])


def _embeddings(model: torch.nn.Module, side: str) -> torch.nn.Module | None:
    """The model's input or output embeddings, or None where it has none: a plain module has no getter, and
    PreTrainedModel's raises NotImplementedError for a model without embeddings (a regression head)."""
    try:
        module = getattr(model, f"get_{side}_embeddings", lambda: None)()
    except NotImplementedError:
        return None
    return module if isinstance(module, torch.nn.Module) else None


@contextlib.contextmanager
def _activations_laid_out(model: torch.nn.Module):
    """Forward hooks, for one call, on the input embeddings, each layer transformers checkpoints (the decoder and
    encoder layers) and the output embeddings: their outputs constrained like the native models' activations.
    Without them XLA lays activations out after the fsdp-split weights and may hold every data shard's rows on
    each device."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    targets: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    targets += [m for m in (_embeddings(model, "input"), _embeddings(model, "output")) if m is not None]
    handles = [m.register_forward_hook(lambda module, args, output: _constrained(output)) for m in targets]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _torch_mode(model: torch.nn.Module, training: bool):
    """The torch model in train or eval mode for one call; each submodule's own flag is put back. The flags are
    set directly: PreTrainedModel.train() may also re-select hub kernels for the torch device."""
    saved = [(module, module.training) for module in model.modules()]
    for module, _ in saved:
        module.training = training
    try:
        yield
    finally:
        for module, flag in saved:
            module.training = flag


def _warn_unknown_styles(weights: dict[str, torch.nn.Parameter], plan: dict[str, str]) -> None:
    """One warning for the weights transformers' tp plan gives a style the bridge does not lay out."""
    unknown = {name: style for name in weights if (style := layout.unknown_style(name, plan)) is not None}
    if unknown:
        shown = ", ".join(f"{name} ({style})" for name, style in list(unknown.items())[:4])
        logging.getLogger(__name__).warning(
            f"transformers' tensor-parallel plan gives {len(unknown)} weights a style jtrainer does not lay out: "
            f"{shown}{', ...' if len(unknown) > 4 else ''}. They are split over 'fsdp' on their largest dimension "
            "and replicated over 'tensor'."
        )


def _is_tensor_tree(value) -> bool:
    leaves = torch.utils._pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def outputs_to_jax(env, outputs):
    """transformers' outputs of torchax tensors as JAX values: a ModelOutput (or dict) becomes `Outputs` with its
    tensor-valued fields (a KV cache is generation state, not a prediction, and is left out); tuples stay tuples."""
    if isinstance(outputs, dict):
        return Outputs({k: outputs_to_jax(env, v) for k, v in outputs.items() if v is not None and _is_tensor_tree(v)})
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(outputs_to_jax(env, v) for v in outputs)
    return env.t2j_iso(outputs)


def holds_torch(value) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in jax.tree.leaves(value))


class TorchModel(ChunkedLossHead, nnx.Module):
    """A transformers `PreTrainedModel` (or any torch module) as a pure function of its weights, under JAX.

    Called with jax arrays it returns `Outputs` of jax arrays; called with torchax tensors (a torch-written
    `compute_loss` inside the step) it returns transformers' own output object of torchax tensors. Attributes it
    does not have are the torch model's (`config`, `main_input_name`, `can_generate`, ...).
    """

    def __init__(self, torch_model: torch.nn.Module):
        self.torch_model: Any = torch_model  # a transformers PreTrainedModel (or a peft model around one)
        trainable: dict[str, torch.nn.Parameter] = {}
        frozen: dict[str, torch.nn.Parameter] = {}
        for name, parameter in torch_model.named_parameters():  # tied weights once, under their first name
            (trainable if parameter.requires_grad else frozen)[name] = parameter
        # transformers' tensor- and expert-parallel plans
        plan = dict(getattr(torch_model, "tp_plan", None) or {}) | dict(getattr(torch_model, "ep_plan", None) or {})
        hidden_size = getattr(getattr(torch_model, "config", None), "hidden_size", None)

        def param(name, tensor, kind=nnx.Param):  # frozen weights are laid out as trainable ones
            axes = layout.logical_axes(name, tuple(tensor.shape), plan, hidden_size)
            return kind(to_array(tensor)) if axes is None else kind(to_array(tensor), logical_axes=axes)

        _warn_unknown_styles(trainable | frozen, plan)
        self.params = nnx.data(_nest({n: param(n, p) for n, p in trainable.items()}))
        self.frozen = nnx.data(_nest({n: param(n, p, Frozen) for n, p in frozen.items()}))
        self.buffers = nnx.data(_nest({n: Buffer(to_array(b)) for n, b in torch_model.named_buffers()}))
        # In a plain dict, as the buffers: replaced (not mutated) after a call, which nnx allows inside a
        # differentiated trace whose model state came in from outside it.
        self.random = nnx.data({"key": RandomKey(jax.random.key(0))})
        self.deterministic = not torch_model.training
        # Static, so a compiled step knows it: the Trainer refreshes it after gradient_checkpointing_enable().
        self.gradient_checkpointing = checkpointing_enabled(torch_model)
        self.remat_policy: str | None = None
        # A transformers causal LM computes its loss alone (skip_logits) in chunks (chunked_loss), with the
        # settings the Trainer gives (models.lm_head.ChunkedLossHead).
        self.chunks_causal_lm_loss = chunked_loss.chunkable(torch_model)
        self.loss_chunk_positions: int | None = None
        self.skip_logits_in_training = False

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "torch_model":
            raise AttributeError(name)
        return getattr(self.__dict__["torch_model"], name)

    @property
    def device(self) -> torch.device:
        """The device torch code inside the step puts new tensors on (HF's `model.device`)."""
        return torchax_compat.DEVICE

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """transformers' switch, for the step: each checkpointed layer rematerialised by jax.checkpoint. A
        `policy` (`full` or a name in jax.checkpoint_policies: torch's values carry no names for the others) is the
        step's; the rest goes to torch."""
        kwargs = dict(gradient_checkpointing_kwargs or {})
        self.remat_policy = kwargs.pop("policy", None)
        remat.check(self.remat_policy, names_activations=False)
        enable = getattr(self.torch_model, "activation_checkpointing_enable", None)  # transformers >= 5.23's name
        if enable is None:
            self.torch_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        else:
            enable(kwargs or None)
        self.gradient_checkpointing = True

    def set_neftune(self, alpha: float | None) -> None:
        """HF's NEFTune: transformers' `neftune_post_forward_hook` on the input embeddings (None: removed). Its
        uniform noise is drawn from the step's key under torchax, so it is a function of (seed, step)."""
        from transformers.integrations.neftune import neftune_post_forward_hook

        embeddings = self.torch_model.get_input_embeddings()
        handle = _NEFTUNE_HOOKS.pop(embeddings, None)
        if handle is not None:
            handle.remove()
            del embeddings.neftune_noise_alpha
        if alpha is not None:
            embeddings.neftune_noise_alpha = float(alpha)
            _NEFTUNE_HOOKS[embeddings] = embeddings.register_forward_hook(neftune_post_forward_hook)

    def _named_variables(self) -> dict[str, nnx.Variable]:
        """Every weight and buffer variable by HF's name."""
        return {name: var for tree in (self.params, self.frozen, self.buffers) for name, var in _flatten(tree).items()}

    def __call__(self, *args, **kwargs):
        with _TRACING:
            if self.chunks_causal_lm_loss and not holds_torch((args, kwargs)):
                labels = kwargs.get("labels")
                if self.resolve_skip_logits(kwargs.pop("skip_logits", None), labels):
                    try:
                        return self._loss_only(args, kwargs)
                    except chunked_loss.NotChunked:
                        _log.debug("%s: the loss from whole logits", type(self.torch_model).__name__)
            return self._call(args, kwargs)

    def _loss_only(self, args, kwargs) -> Outputs:
        """transformers' causal-LM loss without whole logits: the model called without labels, its LM head
        computing the loss in chunks (chunked_loss); the outputs hold the loss and no logits."""
        kwargs = dict(kwargs)
        labels, num_items = kwargs.pop("labels"), kwargs.pop("num_items_in_batch", None)

        def loss_of_hidden(hidden_BxLxD, project):
            return self.head_outputs(hidden_BxLxD, project, labels, num_items, skip_logits=True)[0]

        with chunked_loss.loss_at_head(self.torch_model, tuple(labels.shape), loss_of_hidden) as head:
            outputs = self._call(args, kwargs, head)
        return Outputs({"loss": head.loss, **{k: v for k, v in outputs.items() if k not in ("loss", "logits")}})

    def _call(self, args, kwargs, head: chunked_loss.HeadCall | None = None):
        """The torch model's forward on this module's weights; with `head`, one whose LM head computes the loss
        (`chunked_loss.check_outputs` raises NotChunked before anything of this call is kept)."""
        env = torchax_compat.environment()
        torch_io = holds_torch((args, kwargs))
        flat = self._named_variables()
        remat = self.gradient_checkpointing and not self.deterministic
        with (
            env,
            custom_autograd.own_backward(),
            _torch_mode(self.torch_model, not self.deterministic),
            _weights_kept(self.torch_model),
            _activations_laid_out(self.torch_model),
            attention.routed(self.torch_model),
        ):
            with (
                env.override_property(prng=self.random["key"][...]),
                _rematerialised(self.torch_model, remat, self.remat_policy),
            ):
                tensors = {name: env.j2t_iso(var[...]) for name, var in flat.items()}
                if not torch_io:
                    args, kwargs = env.j2t_iso((args, kwargs))
                what = f"{type(self.torch_model).__name__}'s forward"
                try:
                    with untraceable.no_host_draws(what):
                        outputs = torch.func.functional_call(self.torch_model, tensors, args, kwargs, strict=False)
                except Exception as error:
                    explanation = untraceable.explained(error, what)
                    if explanation is None:
                        raise
                    raise explanation from None
                if head is not None:
                    chunked_loss.check_outputs(outputs, head)
                next_key = env.param.prng
        self.random["key"] = RandomKey(next_key)
        for name in _flatten(self.buffers):  # in-place updates (BatchNorm's running statistics)
            *parents, leaf = name.split(".")
            node = self.buffers
            for part in parents:
                node = node[part]
            node[leaf] = Buffer(env.t2j_iso(tensors[name]))
        return outputs if torch_io else outputs_to_jax(env, outputs)

    def save_pretrained(self, output_dir: str) -> None:
        """The torch model (holding the trained weights) written as transformers.Trainer writes it: a
        `PreTrainedModel` or peft model by its own `save_pretrained`; any other module's `state_dict` to
        `model.safetensors`."""
        if hasattr(self.torch_model, "save_pretrained"):
            self.torch_model.save_pretrained(output_dir)
            return
        import safetensors.torch
        from transformers.utils import logging

        logging.get_logger("transformers.trainer").info(
            "Trainer.model is not a `PreTrainedModel`, only saving its state dict."
        )
        safetensors.torch.save_file(
            self.torch_model.state_dict(), os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"}
        )

    def _torch_tensors(self) -> dict[str, torch.Tensor]:
        """The torch model's parameters and buffers by name."""
        return dict(self.torch_model.named_parameters()) | dict(self.torch_model.named_buffers())

    def read_from_torch(self) -> None:
        """This module's weights and buffers from the torch model (after torch code loaded weights into it)."""
        state = self._torch_tensors()
        for name, var in self._named_variables().items():
            var.value = to_array(state[name])

    def write_to_torch(self) -> None:
        """Copy this module's trainable weights and buffers into the torch model (frozen weights never change:
        a peft model's base is not gathered and copied at each save)."""
        state = self._torch_tensors()
        with torch.no_grad():
            for name, var in (_flatten(self.params) | _flatten(self.buffers)).items():
                state[name].copy_(to_tensor(var[...]))
