"""jtrainer: the Hugging Face Trainer API on one jit-compiled JAX train step.

Importing jtrainer loads transformers' host-side modules only (without torch); the public names load on first
use (`from jtrainer import Trainer`), so `import jtrainer` and the `jtrainer` command's help start in about a
second.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import logging as _logging
import os as _os

# transformers' "PyTorch was not found" advisory is not news to a JAX user.
if _importlib_util.find_spec("torch") is None:
    _os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jtrainer.core import hf_host as _hf_host  # noqa: E402
from jtrainer.core import versions as _versions  # noqa: E402

_versions.check_transformers()
_hf_host.import_host_modules()  # torch, accelerate and peft load when torch code first needs them

__version__ = "0.1.0"

# public name -> the module defining it
_EXPORTS = {
    "CallbackHandler": "jtrainer.core.callbacks",
    "DefaultFlowCallback": "jtrainer.core.callbacks",
    "EarlyStoppingCallback": "jtrainer.core.callbacks",
    "JITCheckpointCallback": "jtrainer.core.callbacks",
    "PrinterCallback": "jtrainer.core.callbacks",
    "ProgressCallback": "jtrainer.core.callbacks",
    "TrainerCallback": "jtrainer.core.callbacks",
    "TrainerControl": "jtrainer.core.callbacks",
    "TrainerState": "jtrainer.core.callbacks",
    "EvalPrediction": "transformers.trainer_utils",
    "PredictionOutput": "transformers.trainer_utils",
    "TrainOutput": "transformers.trainer_utils",
    "get_last_checkpoint": "jtrainer.checkpointing.checkpoint",  # the verified one
    "clear_compiled_steps": "jtrainer.runtime.compiled_steps",
    "initialize": "jtrainer.runtime.startup",  # start-up effects: explicit, not at import
    "TrainingArguments": "jtrainer.trainer.args",
    "Seq2SeqTrainer": "jtrainer.trainer.seq2seq",
    "Seq2SeqTrainingArguments": "jtrainer.trainer.args",
    "Trainer": "jtrainer.trainer.trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jtrainer' has no attribute {name!r}")
    # A script's own logging.basicConfig(...) must still take effect: whatever the imports (orbax, absl) add to
    # the root logger is taken off again.
    root = _logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
