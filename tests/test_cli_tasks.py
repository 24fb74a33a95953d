"""jtrainer.cli.tasks: what a config describes (task, model, data) and how it is built."""

import pytest


def test_a_target_gets_one_eos_whether_or_not_the_tokenizer_appends_it():
    from jtrainer.cli.tasks import with_eos

    assert with_eos([5, 6, 1], eos_token_id=1) == [5, 6, 1]  # T5's tokenizer already ended it with </s>
    assert with_eos([5, 6], eos_token_id=1) == [5, 6, 1]  # the trained BPE tokenizer appends nothing
    assert with_eos([], eos_token_id=1) == [1]


def test_head_width_is_set_or_must_divide():
    from jtrainer.cli.tasks import ModelArguments, fresh_config
    from jtrainer.core.errors import BadInput

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
