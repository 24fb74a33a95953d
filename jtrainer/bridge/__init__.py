"""The torch bridge: transformers' own PyTorch models trained by jtrainer's step (see module.py).

Importing this package imports neither torch nor torchax; `as_nnx` does, for a torch model only.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from jtrainer.bridge.unlowered import unlowered_op  # noqa: F401  (the Trainer names ops with it)

EXTRA = 'pip install "jtrainer[torch]"'


def is_torch_module(model: Any) -> bool:
    """Whether `model` is a torch module (checked without importing torch: a script that built one imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def is_bridged(model: Any) -> bool:
    """Whether `model` is a torch model wrapped for the step (a `module.TorchModel`)."""
    module = sys.modules.get("jtrainer.bridge.module")
    return module is not None and isinstance(model, module.TorchModel)


def decay_parameter_names(model: Any) -> list[str]:
    """transformers.Trainer.get_decay_parameter_names of a torch model: transformers' `get_parameter_names`
    with torch's LayerNorm and HF's name patterns (`optim.NO_DECAY`, the method's five as one alternation;
    tests/test_optim.py holds them equal), without importing transformers.trainer for it (~1.4 s and ~140 MB:
    accelerate, peft and bitsandbytes with it)."""
    import torch
    from transformers.trainer_pt_utils import get_parameter_names

    from jtrainer.numerics import optim

    return get_parameter_names(model, [torch.nn.LayerNorm], [optim.NO_DECAY.pattern])


def as_torch_tensors(tree: Any) -> Any:
    """numpy arrays (in dicts, tuples, lists) as CPU torch tensors sharing their memory: what HF hands a torch
    model's metric functions."""
    import torch

    if isinstance(tree, dict):
        return type(tree)({k: as_torch_tensors(v) for k, v in tree.items()})
    if isinstance(tree, (tuple, list)):
        return type(tree)(as_torch_tensors(v) for v in tree)
    if tree is None:
        return None
    return torch.from_numpy(np_array(tree))


def np_array(value: Any):
    import numpy as np

    array = np.asarray(value)
    return array if array.flags.writeable else array.copy()  # torch wants writable memory


def check_installed(required: bool = True) -> bool:
    """Whether torch and torchax are present (found, not imported: torchax is imported with torchax_compat's
    fixes); if `required`, an error naming the extra when not."""
    for name in ("torch", "torchax"):
        if importlib.util.find_spec(name) is None:
            if not required:
                return False
            raise ImportError(
                f"Training a PyTorch model with jtrainer runs it through torchax; {name} is not installed: {EXTRA}."
            )
    return True


def runs_torch_code() -> bool:
    """Whether a user's torch-written function can run inside the step: the script has torch (it imported it)
    and torchax is installed. A script with torch but no torchax keeps jtrainer's torch-free paths."""
    return "torch" in sys.modules and check_installed(required=False)


def as_nnx(model: Any):
    """The nnx module the step runs: `model` itself when it is one, a `TorchModel` of it when it is torch's."""
    if not is_torch_module(model):
        return model
    check_installed()
    from jtrainer.bridge import adapters
    from jtrainer.bridge.module import TorchModel

    if adapters.is_peft_model(model):
        adapters.check_supported(model)
    meta = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if meta:
        raise ValueError(
            f"{type(model).__name__}'s {meta[0]} (and {len(meta) - 1} more) is on torch's meta device (the model was "
            "built under torch.device('meta')): it holds no values to train. Build it on the CPU, or load its "
            "weights first (model.to_empty(device='cpu') then load_state_dict, or from_pretrained)."
        )
    return TorchModel(model)
