"""jtrainer: the Hugging Face Trainer API on one jit-compiled JAX train step."""

import logging as _logging
import os as _os

# A script's own logging.basicConfig(...) must still take effect: whatever our imports (orbax, absl) add to the
# root logger is taken off again at the end of this file. transformers' "PyTorch was not found" advisory is
# not news to a JAX user.
_ROOT_HANDLERS, _ROOT_LEVEL = list(_logging.getLogger().handlers), _logging.getLogger().level
try:
    import torch as _torch  # noqa: F401
except ImportError:
    _os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jtrainer import versions as _versions  # noqa: E402

_versions.check_transformers()

from transformers.trainer_utils import EvalPrediction, PredictionOutput, TrainOutput  # noqa: E402

from jtrainer.callbacks import (  # noqa: E402
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    JITCheckpointCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from jtrainer.checkpointing.checkpoint import get_last_checkpoint  # noqa: E402  (the verified one)
from jtrainer.runtime.compiled_steps import clear_compiled_steps  # noqa: E402
from jtrainer.runtime.startup import initialize  # noqa: E402  (start-up effects: explicit, not at import)
from jtrainer.trainer.args import TrainingArguments  # noqa: E402
from jtrainer.trainer.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments  # noqa: E402
from jtrainer.trainer.trainer import Trainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "JITCheckpointCallback",
    "EvalPrediction",
    "PredictionOutput",
    "PrinterCallback",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "ProgressCallback",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "clear_compiled_steps",
    "get_last_checkpoint",
    "initialize",
]

for _handler in _logging.getLogger().handlers[:]:
    if _handler not in _ROOT_HANDLERS:
        _logging.getLogger().removeHandler(_handler)
_logging.getLogger().setLevel(_ROOT_LEVEL)
