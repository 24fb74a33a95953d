"""Throughput in the logs: tokens per second and model FLOPs utilisation (`train_mfu`).

MFU = model FLOPs per token x tokens per second / (peak FLOP/s per device x devices). Model FLOPs per token are
the standard training estimate (PaLM's): 6 x non-embedding parameters (forward + backward matmuls), plus 6 x
vocabulary x width when the LM head is the input embedding table (tied: its product is real work that no
non-embedding parameter counts), plus 12 x layers x width x sequence length (attention scores and values,
counted whole although causality masks half of them, as PaLM does). Peaks are the dense bf16 numbers of each
accelerator; there is none for CPUs (no `train_mfu` there).
"""

from __future__ import annotations

import jax

# Dense bf16 peak FLOP/s per device (per chip for TPUs, as jax.devices() lists them).
PEAK_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
}


def peak_flops(device: jax.Device | None = None) -> float | None:
    """The device's dense bf16 peak, by its device_kind (longest matching name), or None (CPU, unknown)."""
    kind = (device or jax.devices()[0]).device_kind
    matches = [name for name in PEAK_FLOPS if kind.startswith(name) or name in kind]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def _config_size(config, *names) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def flops_per_token(model, sequence_length: int) -> float | None:
    """Training FLOPs per token of `model` at this sequence length (None without an HF config)."""
    from jtrainer.models.base import count_parameters

    config = getattr(model, "config", None)
    if config is None:
        return None
    non_embedding = count_parameters(model, exclude_embeddings=True)
    layers = _config_size(config, "num_hidden_layers", "n_layer", "num_layers") or 0
    width = _config_size(config, "hidden_size", "n_embd", "d_model") or 0
    tied_head = 0
    if getattr(model, "logits_use_input_embeddings", False):
        tied_head = (_config_size(config, "vocab_size") or 0) * width
    return 6.0 * (non_embedding + tied_head) + 12.0 * layers * width * sequence_length


def mfu(tokens_per_second: float, model_flops_per_token: float | None) -> float | None:
    peak = peak_flops()
    if peak is None or not model_flops_per_token:
        return None
    return tokens_per_second * model_flops_per_token / (peak * jax.device_count())
