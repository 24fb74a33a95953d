"""HF's callback API, re-exported: jtrainer runs transformers' own callback classes unchanged.

A `transformers.TrainerCallback` written for HF's Trainer works here as is, and the default flow (when to log,
evaluate, save and stop) is decided by HF's own `DefaultFlowCallback`.
"""

from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "PrinterCallback",
    "ProgressCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
]
