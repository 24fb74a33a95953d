"""TRL's trainers on jtrainer: `from jtrainer.trl import SFTTrainer, SFTConfig, DPOTrainer, DPOConfig`.

TRL's signatures, config fields and dataset preparation; the losses inside jtrainer's compiled step. Needs the
`trl` extra (`pip install -e ".[trl]"`); `import jtrainer` never imports TRL.
"""

from jtrainer.trl.config import DPOConfig, SFTConfig
from jtrainer.trl.dpo import DPOTrainer
from jtrainer.trl.sft import SFTTrainer

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]
