"""The transformers jtrainer mirrors, checked first when jtrainer is imported (before any of transformers'
submodules load: some, with peft installed, import peft, which may import transformers' pieces of its own)."""

from __future__ import annotations

import transformers
from packaging import version

# The HF fields this front end mirrors (activation_checkpointing*, ...) are those of transformers >= 5.23.
MIN_TRANSFORMERS = "5.23"


def check_transformers() -> None:
    if version.parse(transformers.__version__) < version.parse(MIN_TRANSFORMERS):
        raise ImportError(
            f"jtrainer needs transformers>={MIN_TRANSFORMERS},<6 (found {transformers.__version__}): "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS},<6'."
        )
