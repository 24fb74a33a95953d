"""Seq2SeqTrainer and Seq2SeqTrainingArguments: HF's API, generating with jtrainer's compiled decoding.

With `predict_with_generate`, evaluation and prediction return generated token ids (padded with the pad token to
the generation config's `max_length`, as HF pads them) instead of logits; the loss is still the model's loss on
the labels. Works with encoder-decoder models (T5: the decoder's start token + generated ids) and with causal LMs
(prompt + generated ids; prompts are left-aligned before decoding, as decoder-only generation needs).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from transformers import GenerationConfig

from jtrainer.models.generation import generate
from jtrainer.parallel import distributed, sharding
from jtrainer.trainer.args import Seq2SeqTrainingArguments, TrainingArguments  # noqa: F401  (public here too)
from jtrainer.trainer.trainer import Trainer


def left_align(input_ids: np.ndarray, attention_mask: np.ndarray, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts -> left-padded ones (each row's tokens moved to the end), for decoder-only decoding."""
    ids = np.full_like(input_ids, pad_token_id)
    mask = np.zeros_like(attention_mask)
    width = input_ids.shape[1]
    for row, keep in enumerate(attention_mask.astype(bool)):
        tokens = input_ids[row][keep]
        ids[row, width - len(tokens) :] = tokens
        mask[row, width - len(tokens) :] = 1
    return ids, mask


def pad_to_width(array: np.ndarray, width: int, pad_token_id: int) -> np.ndarray:
    """HF's `_pad_tensors_to_max_len`: right-pad [rows, length] to `width` columns with the pad token."""
    if array.shape[-1] >= width:
        return array
    padded = np.full((array.shape[0], width), pad_token_id, dtype=array.dtype)
    padded[:, : array.shape[-1]] = array
    return padded


class Seq2SeqTrainer(Trainer):
    """HF's Seq2SeqTrainer: `evaluate(**gen_kwargs)` / `predict(**gen_kwargs)` generate when
    `args.predict_with_generate` is set."""

    args: Seq2SeqTrainingArguments  # HF's Seq2SeqTrainer reads the generation fields of these

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = getattr(self.args, "generation_config", None)
        if isinstance(config, GenerationConfig):
            self.generation_config = config
        elif config is not None:
            self.generation_config = GenerationConfig.from_pretrained(config)
        else:
            self.generation_config = getattr(self.model, "generation_config", None) or (
                GenerationConfig.from_model_config(self.model.config)
            )
        self._gen_kwargs: dict[str, Any] = {}

    def _with_generation_defaults(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """HF's precedence: explicit gen_kwargs > args.generation_max_length / generation_num_beams."""
        gen_kwargs = dict(gen_kwargs)
        if (
            gen_kwargs.get("max_length") is None
            and gen_kwargs.get("max_new_tokens") is None
            and self.args.generation_max_length is not None
        ):
            gen_kwargs["max_length"] = self.args.generation_max_length
        if gen_kwargs.get("num_beams") is None and self.args.generation_num_beams is not None:
            gen_kwargs["num_beams"] = self.args.generation_num_beams
        return {k: v for k, v in gen_kwargs.items() if v is not None}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs):
        self._gen_kwargs = self._with_generation_defaults(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs):
        self._gen_kwargs = self._with_generation_defaults(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    # ------------------------------------------------------------------------- hooks of the evaluation loop
    def _gathers_completing_rows(self) -> bool:
        return True  # HF's Seq2SeqTrainer.evaluate / predict: gather_function = accelerator.gather

    def _generates(self) -> bool:
        return bool(self.args.predict_with_generate)

    def _pad_token_id(self) -> int:
        for source in (self.processing_class, self.generation_config, self.model.config):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        eos = getattr(self.generation_config, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                "predict_with_generate pads generated ids with the pad token, and neither the processing_class, "
                "the generation config nor the model config has a pad_token_id (or an eos_token_id)."
            )
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos)

    def _prediction_width(self) -> int:
        """The width HF pads generated ids and labels to: the generation config's max_length (or
        max_new_tokens + 1)."""
        config = self.generation_config
        width = config.max_length if config.max_length is not None else 20
        if config.max_new_tokens is not None:
            width = max(width, config.max_new_tokens + 1)
        return width

    def _generate_batch(self, batch: dict[str, np.ndarray], rows: int) -> np.ndarray:
        """Generated ids for the first `rows` (global) rows of a padded batch. All its rows are decoded (the
        batch's shape is fixed, so decoding compiles once per length bucket), then cut. With many processes,
        each one's rows are placed on the mesh like an evaluation batch, every process runs the same decoding
        program, and the ids are gathered on every process."""
        if not self._held.decodes_in_compiled_step:
            return pad_to_width(self._generate_on_host(batch, rows), self._prediction_width(), self._pad_token_id())
        main = getattr(self.model, "main_input_name", "input_ids")
        input_ids = np.asarray(batch[main])
        mask = np.asarray(batch["attention_mask"]) if "attention_mask" in batch else np.ones_like(input_ids)
        pad = self._pad_token_id()
        if not hasattr(self.model, "encode"):
            input_ids, mask = left_align(input_ids, mask, pad)
        if jax.process_count() == 1:
            ids = generate(self.model, input_ids, mask, self.generation_config, **self._gen_kwargs)
        else:
            placed = sharding.put_global(
                {"ids": input_ids, "mask": mask},
                self.mesh,
                row_dim=0,
                global_rows=input_ids.shape[0] * jax.process_count(),
            )
            with self._mesh_context():
                ids = generate(self.model, placed["ids"], placed["mask"], self.generation_config, **self._gen_kwargs)
            ids = distributed.gather_rows(ids)
        return pad_to_width(ids[:rows], self._prediction_width(), pad)

    def _generate_on_host(self, batch: dict[str, np.ndarray], rows: int) -> np.ndarray:
        """Generated ids of a model that decodes outside the compiled step (a torch model: transformers' own
        `generate`, HF's Seq2SeqTrainer.prediction_step call), from the trained weights, without the labels."""
        inputs = {k: v[:rows] for k, v in batch.items() if k not in self.label_names}
        labels = batch.get("labels")
        if labels is not None and "decoder_input_ids" in inputs and labels.shape == inputs["decoder_input_ids"].shape:
            inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
        return self._held.generate_on_host(inputs, self.generation_config, self._gen_kwargs, self._sync_model)

    def _prediction_labels(self, labels: np.ndarray) -> np.ndarray:
        return pad_to_width(labels, self._prediction_width(), self._pad_token_id())


__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]
