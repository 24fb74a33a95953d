"""Which of HF's Trainer override points a subclass may use here, and a clear error for those it may not.

jtrainer calls `compute_loss` inside its compiled step, and calls `evaluation_loop`, `create_optimizer`,
`create_scheduler`, `get_*_dataloader`, `log`, `evaluate`, `predict`, `save_model` ... by name as HF does, so
overriding those works. HF's per-batch torch hooks (`training_step`, `prediction_step`, `_prepare_inputs`, ...)
have no place in one compiled step: a subclass overriding one would be silently ignored, so construction refuses it.
"""

from __future__ import annotations

from typing import Any

# HF's torch-side hooks -> what to override instead.
UNSUPPORTED_OVERRIDES: dict[str, str] = {
    "training_step": "compute_loss (it runs inside the compiled train step; the backward pass and the optimizer "
    "update are jax.grad and optax)",
    "prediction_step": "compute_loss (evaluation calls it with return_outputs=True) or preprocess_logits_for_metrics",
    "_prepare_inputs": "the data collator",
    "_prepare_input": "the data collator",
    "compute_loss_context_manager": "TrainingArguments bf16/fp16 (mixed precision is a cast inside the step)",
    "autocast_smart_context_manager": "TrainingArguments bf16/fp16 (mixed precision is a cast inside the step)",
    "get_batch_samples": "get_train_dataloader (returning any iterable of batches)",
    "_get_num_items_in_batch": "compute_loss (it receives num_items_in_batch)",
    "_wrap_model": "the mesh arguments (mesh_shape, logical_axis_rules)",
    "_clip_grad_norm": "max_grad_norm, or an optax chain passed as optimizers=(tx, None)",
    "_get_grad_norm": "max_grad_norm, or an optax chain passed as optimizers=(tx, None)",
}


# HF's public methods that belong to torch's machinery (accelerate, the per-batch torch step): called, each says why
# it has no counterpart and what does its work here.
REFUSED_METHODS: dict[str, str] = {
    **{name: f"override {instead} instead" for name, instead in UNSUPPORTED_OVERRIDES.items() if name[0] != "_"},
    "create_accelerator_and_postprocess": "there is no accelerate: the mesh arguments (mesh_shape) place the step",
    "get_optimizer_cls_and_kwargs": "--optim names map to optax rules (jtrainer.numerics.optim.make_optimizer)",
    "get_resumed_dataloader": "a resumed run skips its consumed batches itself",
}


def _refused(name: str, instead: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"Trainer.{name} is part of transformers.Trainer's torch machinery, which jtrainer replaces with one "
            f"compiled JAX step: {instead}."
        )

    method.__name__ = name
    method.__doc__ = f"HF's {name}: refused here ({instead})."
    return method


class RefusedMethods:
    """HF's torch-side methods, each raising one line that names what replaces it (see REFUSED_METHODS)."""


for _name, _instead in REFUSED_METHODS.items():
    setattr(RefusedMethods, _name, _refused(_name, _instead))


def overrides(trainer: Any, name: str) -> bool:
    """Whether `trainer`'s class replaces the jtrainer Trainer's own method `name` (or defines one it lacks): the
    nearest class in its MRO defining `name` is the user's, not one of jtrainer's."""
    for cls in type(trainer).__mro__:
        if name in vars(cls):
            return not cls.__module__.startswith("jtrainer.")
    return False


def check_overrides(trainer: Any) -> None:
    """Raise, naming the method and the supported alternative, when a subclass overrides a hook never called."""
    for name, instead in UNSUPPORTED_OVERRIDES.items():
        if overrides(trainer, name):
            raise TypeError(
                f"{type(trainer).__name__}.{name} overrides a hook of transformers.Trainer that jtrainer does not "
                f"call (training is one compiled JAX step): it would be silently ignored. Override {instead} instead."
            )


def check_loader(trainer: Any, loader: Any, method: str):
    """A dataloader method's result (perhaps overridden): jtrainer's BatchLoader, or any iterable of batches as
    HF accepts (a torch DataLoader, a generator), read through data.IterableBatches."""
    import jax

    from jtrainer.trainer.data import BatchLoader, IterableBatches

    if isinstance(loader, (BatchLoader, IterableBatches)):
        return loader
    if not hasattr(loader, "__iter__"):
        raise TypeError(
            f"{type(trainer).__name__}.{method} returned a {type(loader).__name__}, which is not an iterable of "
            "batches: return a torch DataLoader, a generator of dict batches, or jtrainer's BatchLoader."
        )
    return IterableBatches(loader, processes=jax.process_count())


def check_optimizer_override(trainer: Any) -> None:
    """create_optimizer (perhaps overridden) must leave an optax transformation: the update runs in the step."""
    import optax

    if trainer._translated_optimizer is None and not isinstance(trainer.optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{type(trainer).__name__}.create_optimizer set self.optimizer to a {type(trainer.optimizer).__name__}; "
            "jtrainer needs an optax.GradientTransformation (the update runs inside the compiled step). Build it "
            "with optax, or pass optimizers=(tx, None) / optimizer_cls_and_kwargs."
        )
