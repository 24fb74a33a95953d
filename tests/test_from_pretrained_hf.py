"""from_pretrained / from_config with transformers' keywords and rules, against transformers itself: another
head or a base model (missing weights initialised, unused ones reported), `config=` with other labels
(HF's size-mismatch error, then `ignore_mismatched_sizes`), keywords that override the config, dtypes, Hub
ids from huggingface_hub's cache offline, and the options that cannot apply."""

import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_llama_config

from jtrainer.core.errors import BadInput
from jtrainer.models import AutoModelForCausalLM, AutoModelForSequenceClassification, hf_io
from jtrainer.models.llama import LlamaForCausalLM

SCRIPT_KEYWORDS = dict(from_tf=False, cache_dir=None, revision="main", token=None, trust_remote_code=False)


def _bert_config(**overrides):
    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        **overrides,
    )


def test_a_masked_lm_base_loads_into_a_classifier_as_transformers_does(tmp_path):
    torch.manual_seed(0)
    transformers.BertForMaskedLM(_bert_config()).save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path, num_labels=3)
    theirs, their_info = transformers.BertForSequenceClassification.from_pretrained(
        tmp_path, config=config, output_loading_info=True
    )
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers.modeling_utils").addHandler(handler)  # where transformers logs its report
    try:
        ours, info = AutoModelForSequenceClassification.from_pretrained(
            str(tmp_path), config=config, output_loading_info=True, **SCRIPT_KEYWORDS
        )
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(handler)
    assert their_info["missing_keys"] and info["missing_keys"] == their_info["missing_keys"]  # pooler, classifier
    assert their_info["unexpected_keys"] and info["unexpected_keys"] == their_info["unexpected_keys"]  # MLM head
    assert any(
        "BertForSequenceClassification LOAD REPORT from" in m and "classifier.weight  MISSING" in m for m in seen
    )
    assert ours.config.num_labels == 3
    # The encoder is the checkpoint's; the new head has the shape the config asks for.
    state = hf_io.to_hf_state_dict(ours)
    np.testing.assert_array_equal(
        state["bert.embeddings.word_embeddings.weight"], theirs.bert.embeddings.word_embeddings.weight.detach().numpy()
    )
    assert state["classifier.weight"].shape == tuple(theirs.classifier.weight.shape) == (3, 32)


def test_other_labels_than_the_checkpoints_fail_as_in_transformers_unless_sizes_may_differ(tmp_path):
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(_bert_config(num_labels=2)).save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path, num_labels=3)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.BertForSequenceClassification.from_pretrained(tmp_path, config=config)
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for classifier.weight: copying a param with shape "
        r"\(2, 32\) from checkpoint, the shape in current model is \(3, 32\)",
    ):
        AutoModelForSequenceClassification.from_pretrained(str(tmp_path), config=config)
    ours = AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path), config=config, ignore_mismatched_sizes=True
    )
    assert hf_io.to_hf_state_dict(ours)["classifier.weight"].shape == (3, 32)
    ours.save_pretrained(str(tmp_path / "out"))  # a 3-label config over a 3-row classifier: torch loads it
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "out")
    assert back.classifier.weight.shape == (3, 32) and back.config.num_labels == 3


def test_keywords_override_the_config_and_dtypes_are_hfs(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), rms_norm_eps=1e-3, dtype=torch.bfloat16)
    assert model.config.rms_norm_eps == 1e-3  # a config attribute: the config's, as HF
    assert model.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert LlamaForCausalLM.from_pretrained(str(tmp_path), dtype="float16").lm_head.kernel[...].dtype == jnp.float16
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype="auto").lm_head.kernel[...].dtype == jnp.float32
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path)).lm_head.kernel[...].dtype == jnp.float32
    fresh = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype="bfloat16", trust_remote_code=False)
    assert fresh.lm_head.kernel[...].dtype == jnp.bfloat16
    with pytest.raises(BadInput, match="dtype='float8x': use 'auto'"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype="float8x")


def test_a_hub_id_is_read_from_huggingface_hubs_cache_offline(tmp_path, monkeypatch):
    """The Hub's cache layout (models--org--name/snapshots/REV, refs/main), as huggingface_hub leaves it."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    snapshot = tmp_path / "cache" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    reference.save_pretrained(snapshot)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(
        "tiny-org/tiny-llama", cache_dir=str(tmp_path / "cache"), revision="main", token=None
    )
    ids = np.random.RandomState(0).randint(0, 64, (1, 7))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids)).logits), expected, atol=2e-5)
    with pytest.raises(OSError, match="not-there/nothing is not a local folder and was not found in the local Hub"):
        AutoModelForCausalLM.from_pretrained("not-there/nothing", cache_dir=str(tmp_path / "cache"))


def test_options_that_cannot_apply_are_refused_by_name(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    with pytest.raises(BadInput, match="from_tf=True: jtrainer reads safetensors weights only"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), from_tf=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.Custom"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="trust_remote_code=True: this checkpoint's own modelling code"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True)
    # Harmless ones are accepted: the weights are read lazily anyway, the attention is jtrainer's own.
    AutoModelForCausalLM.from_pretrained(str(tmp_path), low_cpu_mem_usage=True, attn_implementation="sdpa")
    shutil.rmtree(tmp_path)


def test_a_torch_trainer_checkpoint_loads_and_resumes(tmp_path):
    """transformers.Trainer's checkpoint-N (torch optimizer.pt, no train state): from_pretrained loads its weights
    and it resumes (tests/test_resume_torch_checkpoint_hf.py compares the resumed run with torch's)."""
    from conftest import scratch_dir, token_rows, torch_rows

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    hf = transformers.Trainer(
        model=transformers.LlamaForCausalLM(tiny_llama_config()),
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=1, save_steps=1, report_to="none", use_cpu=True
        ),
        train_dataset=torch_rows(token_rows(4, length=8)),
    )
    hf.train()
    folder = str(tmp_path / "hf" / "checkpoint-1")
    ours = Trainer(
        model=AutoModelForCausalLM.from_pretrained(folder),
        args=TrainingArguments(output_dir=scratch_dir(), max_steps=2, report_to="none"),
        train_dataset=token_rows(4, length=8),
    )
    from jtrainer.checkpointing import checkpoint

    checkpoint.verify_checkpoint(folder)
    ours.train(resume_from_checkpoint=folder)
    assert ours.state.global_step == 2 and [h["step"] for h in ours.state.log_history][-1] == 2
