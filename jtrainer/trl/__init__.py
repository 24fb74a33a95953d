"""TRL's trainers on jtrainer: `from jtrainer.trl import SFTTrainer, SFTConfig, DPOTrainer, DPOConfig`.

TRL's signatures, config fields and dataset preparation; the losses inside jtrainer's compiled step. Needs the
`trl` extra (`pip install -e ".[trl]"`); `import jtrainer` never imports TRL, and this package imports it (and
torch, which TRL needs) when one of its names is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "SFTConfig": "jtrainer.trl.config",
    "DPOConfig": "jtrainer.trl.config",
    "SFTTrainer": "jtrainer.trl.sft",
    "DPOTrainer": "jtrainer.trl.dpo",
}

if TYPE_CHECKING:
    from jtrainer.trl.config import DPOConfig, SFTConfig
    from jtrainer.trl.dpo import DPOTrainer
    from jtrainer.trl.sft import SFTTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jtrainer.trl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]
