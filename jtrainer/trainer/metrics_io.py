"""The Trainer's metric helpers, as HF's: metrics_format, log_metrics, save_metrics."""

from __future__ import annotations

import datetime
import json
from typing import Any

from jtrainer.core import storage
from jtrainer.trainer.trainer_parts import TrainerParts


class MetricsMixin(TrainerParts):
    """HF's formatting and saving of a split's metrics (process 0 prints and writes)."""

    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """HF's format: runtimes as h:mm:ss.cc, total_flos in GF, floats rounded to 4 places."""
        out: dict[str, Any] = {}
        for key, value in metrics.items():
            if "_mem_" in key:
                out[key] = f"{int(value) >> 20}MB"
            elif "_runtime" in key:
                out[key] = f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"
            elif key == "total_flos":
                out[key] = f"{int(value) >> 30}GF"
            elif isinstance(value, float):
                out[key] = round(value, 4)
            else:
                out[key] = value
        return out

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        formatted = self.metrics_format(metrics)
        width = max(len(str(k)) for k in formatted)
        value_width = max(len(str(v)) for v in formatted.values())
        for key in sorted(formatted):
            print(f"  {key: <{width}} = {formatted[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        if not self.is_world_process_zero():
            return
        out = self.args.output_dir
        storage.makedirs(out)
        storage.write_text(storage.join(out, f"{split}_results.json"), json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = storage.join(out, "all_results.json")
            all_metrics = json.loads(storage.read_text(path)) if storage.exists(path) else {}
            all_metrics.update(metrics)
            storage.write_text(path, json.dumps(all_metrics, indent=4, sort_keys=True))
