"""peft models (LoRA and other adapters) on the bridge: what transformers.Trainer does differently for them.

A `peft.PeftModel` is a torch module like any other to the bridge: its adapters are its trainable parameters
(`nnx.Param`, the only ones with gradients and optimizer state) and the base model's weights are frozen (model
state, sharded like parameters, left out of jtrainer's checkpoints). Here: HF's introspection of the base model,
and the adapter methods the bridge trains or refuses. Importing this module imports neither torch nor peft.
"""

from __future__ import annotations

import sys
from typing import Any

# peft's method types (PeftType values) whose forward the bridge has been checked to trace exactly, side by side
# with torch (tests/test_bridge_peft.py). Others are refused by name rather than trained on trust.
# (LoRA's variants DoRA and rsLoRA are LORA.) BOFT and AdaLoRA call torch ops torchax cannot run; AdaLoRA also
# needs update_and_allocate called between steps, which transformers.Trainer does not do.
TRAINED = frozenset(
    {
        *("LORA", "IA3", "LOHA", "LOKR", "VERA", "OFT", "FOURIERFT", "LN_TUNING"),
        *("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"),  # prompt learning: virtual tokens before the rows
    }
)


def is_peft_model(model: Any) -> bool:
    """transformers' _is_peft_model: a peft `PeftModel` or `PeftMixedModel` (peft is never imported here: a
    script that built one imported it)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    classes = tuple(c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if c)
    return isinstance(model, classes)


def inspected(model: Any) -> Any:
    """The model whose class and forward transformers.Trainer inspects (labels, columns, loss kwargs): a peft
    model's base model (HF's unwrap_peft_model), any other model itself."""
    if not is_peft_model(model):
        return model
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model.base_model.model  # PeftMixedModel has no get_base_model


def _method(config: Any) -> str:
    """An adapter config's peft method ("LORA", "IA3", ...)."""
    return str(getattr(config.peft_type, "value", config.peft_type))


def method_names(model: Any) -> list[str]:
    """The peft method of each adapter a peft model holds."""
    return [_method(config) for config in model.peft_config.values()]


def check_supported(model: Any) -> None:
    """A one-line error for a peft method the bridge does not train exactly, before anything is compiled."""
    for name, config in model.peft_config.items():
        method = _method(config)
        if method not in TRAINED:
            raise NotImplementedError(
                f"The peft adapter {name!r} uses {method}, which jtrainer's torch bridge has not been verified to "
                f"train exactly; supported methods: {', '.join(sorted(TRAINED))}."
            )
