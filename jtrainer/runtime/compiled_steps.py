"""The process-wide caches of jitted train and eval steps, bounded and clearable.

A step depends only on structure (the model's graph, the loss rules, the optimizer recipe, the layout), so later
Trainers of the same structure (trials of a hyperparameter search, a second `train()`) reuse the compiled program.
The keys hold the user's closures (compute_loss, preprocess_logits_for_metrics) and the values the executables:
each cache keeps the most recently used `MAX_ENTRIES`, and `clear_compiled_steps()` drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 16


class StepCache:
    """A least-recently-used mapping of step keys to jitted steps, at most `max_entries` long."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[Any, Any] = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __getitem__(self, key):
        self._entries.move_to_end(key)
        return self._entries[key]

    def __setitem__(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


TRAIN_STEPS = StepCache()
EVAL_STEPS = StepCache()


def clear_compiled_steps() -> None:
    """Forget every cached train and eval step (the next Trainer compiles its own)."""
    TRAIN_STEPS.clear()
    EVAL_STEPS.clear()
