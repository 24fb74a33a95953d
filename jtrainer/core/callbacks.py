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


class JITCheckpointCallback(TrainerCallback):
    """HF's `enable_jit_checkpoint` callback. jtrainer always saves the current step's checkpoint on SIGTERM
    during train(); with this callback in the list (added by `enable_jit_checkpoint=True`, as HF adds it),
    train() then returns, as HF's graceful stop, where otherwise the process exits with code 0."""

    def __init__(self):
        self.trainer = None
        self.checkpoint_saved = False  # set by the Trainer once the SIGTERM checkpoint is written

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.checkpoint_saved = False

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.checkpoint_saved:  # HF's: no second save of the same step, and the run ends
            control.should_save = False
            control.should_training_stop = True


__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "JITCheckpointCallback",
    "PrinterCallback",
    "ProgressCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
]
