"""HF's `from_pretrained` / `from_config` keywords for jtrainer's models: where the folder is (a local folder, a
gs:// / s3:// URL, or a Hub id through huggingface_hub's cache), which config, which dtype, and what cannot apply.

transformers' own meanings: `config=` replaces config.json; keywords naming config attributes override them
(the rest go to the model's constructor); `cache_dir`, `revision`, `token`, `local_files_only`,
`force_download`, `subfolder` locate a Hub snapshot (offline rules: `HF_HUB_OFFLINE=1` as local_files_only);
`dtype` / `torch_dtype` ("auto", a name, a torch or numpy dtype) cast the weights. Options with no meaning
here are accepted when harmless (`low_cpu_mem_usage`: weights are always read lazily; `attn_implementation`:
jtrainer's attention is its own; `device_map`: placement is the mesh's) and refused where they would change
the result (`from_tf`, `from_flax`, remote code).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import numpy as np

from jtrainer.core.errors import BadInput

logger = logging.getLogger(__name__)

# Keywords of transformers' from_pretrained that only locate files.
HUB_KEYWORDS = (
    "cache_dir",
    "revision",
    "token",
    "local_files_only",
    "force_download",
    "subfolder",
    "proxies",
    "use_auth_token",
)
# Accepted and without effect here (see the module doc).
HARMLESS_KEYWORDS = (
    "low_cpu_mem_usage",
    "attn_implementation",
    "device_map",
    "use_safetensors",
    "_fast_init",
    "key_mapping",
    "tp_plan",
    "weights_only",
)
_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*", "*.py"]


def resolve_folder(name: str, hub: dict[str, Any]) -> str:
    """A local folder holding `name`'s files: itself, a gs:// / s3:// download, or a Hub snapshot."""
    from jtrainer.core import storage

    subfolder = hub.get("subfolder") or ""
    if storage.is_url(name):
        return os.path.join(storage.fetched(name), subfolder)
    if os.path.isdir(name):
        return os.path.join(name, subfolder)
    if os.path.exists(name):
        raise BadInput(f"{name!r} is a file; from_pretrained takes a folder (config.json + model.safetensors).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = hub.get("local_files_only") or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    # huggingface_hub 1.x dropped `proxies` from the signature (its decorator still takes it): passed on when given.
    passed_on: dict[str, Any] = {"proxies": hub["proxies"]} if hub.get("proxies") else {}
    try:
        folder = snapshot_download(
            name,
            revision=hub.get("revision"),
            cache_dir=hub.get("cache_dir"),
            token=hub.get("token", hub.get("use_auth_token")),
            local_files_only=bool(offline),
            force_download=bool(hub.get("force_download")),
            allow_patterns=[f"{subfolder}/{p}" if subfolder else p for p in _FILES],
            **passed_on,
        )
    except (HFValidationError, RepositoryNotFoundError, LocalEntryNotFoundError) as error:
        where = "in the local Hub cache (offline)" if offline else "on the Hub"
        raise OSError(
            f"{name} is not a local folder and was not found {where} ({type(error).__name__}): pass the folder of a "
            "model saved with save_pretrained, or a Hub id that is cached (or reachable)."
        ) from None
    return os.path.join(folder, subfolder)


def refuse_inapplicable(kwargs: dict[str, Any], config=None) -> None:
    """Options that would change what is loaded and that jtrainer cannot honour: one clear error each."""
    if kwargs.get("from_tf"):
        raise BadInput(
            "from_tf=True: jtrainer reads safetensors weights only; convert the TensorFlow checkpoint "
            "with transformers (from_pretrained(..., from_tf=True).save_pretrained(folder)) first."
        )
    if kwargs.get("from_flax"):
        raise BadInput(
            "from_flax=True: jtrainer reads safetensors weights only; save the checkpoint with "
            "save_pretrained (safetensors) first."
        )
    if kwargs.get("use_safetensors") is False:
        raise BadInput("use_safetensors=False: jtrainer reads safetensors weights only (no pytorch_model.bin).")
    if kwargs.get("trust_remote_code") and config is not None and getattr(config, "auto_map", None):
        raise BadInput(
            f"trust_remote_code=True: this checkpoint's own modelling code ({config.auto_map}) is PyTorch "
            "and cannot run in jtrainer; use a model of a family jtrainer implements."
        )


def split_keywords(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Hub keywords, the rest), dropping the harmless ones and the refused ones' False values."""
    hub = {k: kwargs.pop(k) for k in HUB_KEYWORDS if k in kwargs}
    for key in (*HARMLESS_KEYWORDS, "from_tf", "from_flax", "trust_remote_code"):
        kwargs.pop(key, None)
    return hub, kwargs


def config_and_model_kwargs(config, kwargs: dict[str, Any]):
    """HF's rule: keywords that name attributes of the config override them (on a copy); the rest are the
    model constructor's."""
    config = copy.deepcopy(config)
    model_kwargs = {}
    for key, value in kwargs.items():
        if hasattr(config, key):
            setattr(config, key, value)
        else:
            model_kwargs[key] = value
    return config, model_kwargs


def read_config(directory: str, config_class: Any = None) -> Any:
    """`config_class.from_pretrained(directory)` (None: AutoConfig's class for the folder's `model_type`) without
    importing torch: transformers turns config.json's `dtype` name into a torch dtype, importing torch (seconds,
    and a few hundred MB) whenever it is installed. The name is kept as written; `weight_dtype` reads names."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_dict, _ = PretrainedConfig.get_config_dict(directory)
    if config_class is None:
        model_type = config_dict.get("model_type", "")
        if model_type not in CONFIG_MAPPING:  # remote code or an unknown type: AutoConfig's own rules and errors
            return AutoConfig.from_pretrained(directory)
        config_class = CONFIG_MAPPING[model_type]
    names = {key: config_dict.pop(key) for key in ("dtype", "torch_dtype") if isinstance(config_dict.get(key), str)}
    config = config_class.from_dict(config_dict)
    if names:
        config.dtype = names.get("dtype") or names["torch_dtype"]
    return config


def weight_dtype(dtype, config) -> np.dtype | None:
    """The dtype to load weights in: None keeps jtrainer's float32 master weights; "auto" the config's dtype
    (`dtype` / `torch_dtype` in config.json), a name ("bfloat16"), a torch, jax or numpy dtype as given."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return None if saved is None else weight_dtype(saved, config)
    if not isinstance(dtype, str) and type(dtype).__module__.startswith("torch"):
        dtype = str(dtype).rsplit(".", 1)[-1]  # torch.bfloat16 -> "bfloat16"
    try:
        import jax.numpy as jnp

        return np.dtype(getattr(jnp, dtype) if isinstance(dtype, str) else dtype)
    except (TypeError, AttributeError):
        raise BadInput(f"dtype={dtype!r}: use 'auto', a name such as 'bfloat16' or 'float32', or a dtype.") from None
