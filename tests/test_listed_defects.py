"""Small defects found by reading the code (issue: "one step for the house"), each pinned by a test."""

import numpy as np
import pytest
from conftest import count_compiles, scratch_dir, short_run_args, token_rows
from flax import nnx


def test_a_target_gets_one_eos_whether_or_not_the_tokenizer_appends_it():
    from jtrainer.cli.tasks import with_eos

    assert with_eos([5, 6, 1], eos_token_id=1) == [5, 6, 1]  # T5's tokenizer already ended it with </s>
    assert with_eos([5, 6], eos_token_id=1) == [5, 6, 1]  # the trained BPE tokenizer appends nothing
    assert with_eos([], eos_token_id=1) == [1]


def test_head_width_is_set_or_must_divide():
    from jtrainer.cli.tasks import ModelArguments, fresh_config
    from jtrainer.errors import BadInput

    # The shipped T5 v1.1-small shape: 6 heads of 64 over a width of 512 (512 // 6 would build 85-wide heads).
    t5 = fresh_config(ModelArguments(model_type="t5", hidden_size=512, num_attention_heads=6, head_dim=64), 128)
    assert t5.d_kv == 64
    with pytest.raises(BadInput, match="hidden_size=512 is not divisible by num_attention_heads=6: set head_dim"):
        fresh_config(ModelArguments(model_type="t5", hidden_size=512, num_attention_heads=6), 128)
    assert fresh_config(ModelArguments(model_type="llama", hidden_size=64, num_attention_heads=4), 128).head_dim == 16


def test_the_shipped_t5_config_names_its_head_width():
    import os

    import yaml

    from jtrainer.cli import DEFAULT_CONFIG

    config = yaml.safe_load(open(os.path.join(os.path.dirname(DEFAULT_CONFIG), "t5_summarisation.yaml")))
    assert config["hidden_size"] == 512 and config["num_attention_heads"] == 6 and config["head_dim"] == 64


def test_the_finite_check_of_saves_compiles_once(tmp_path):
    """save_steps with load_best_model / NaN checks: the parameters' finite check is one program, not one per save."""
    from conftest import tiny_llama_config

    from jtrainer import Trainer
    from jtrainer.models.llama import LlamaForCausalLM

    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=short_run_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1),
        train_dataset=token_rows(16),
    )
    from jtrainer.trainer import saving

    saving._all_finite.clear_cache()  # another test of this worker may have compiled it for this layout
    with count_compiles("_all_finite") as compiles:
        trainer.train()
    assert len(compiles) == 1  # four saves, one program


class WithDropout(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.head(self.drop(self.embed(input_ids)))}


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_evaluation_leaves_the_model_in_its_mode(mode):
    from jtrainer import Trainer

    model = WithDropout(nnx.Rngs(0))
    getattr(model, mode)()
    trainer = Trainer(
        model=model, args=short_run_args(scratch_dir(), per_device_eval_batch_size=4), eval_dataset=token_rows(8)
    )
    trainer.evaluate()
    assert model.drop.deterministic is (mode == "eval")


def test_training_runs_in_train_mode_whatever_mode_the_model_is_in():
    """HF's training_step calls model.train(): dropout is on even if the script left the model in eval mode."""
    from jtrainer import Trainer

    def losses(mode):
        model = WithDropout(nnx.Rngs(0))
        getattr(model, mode)()
        trainer = Trainer(model=model, args=short_run_args(scratch_dir(), max_steps=2), train_dataset=token_rows(8))
        trainer.train()
        assert model.drop.deterministic is (mode == "eval")  # the model's own mode is left as it was
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    np.testing.assert_allclose(losses("eval"), losses("train"))
