"""The code on every page of the manual runs: each page's ```python blocks in order, in one namespace, in a fresh
folder holding the tiny models, tokenizers and rows the page's names refer to (built here, nothing downloaded). A
block that cannot run on this machine is preceded by `<!-- not run: why -->`, and this test says which it skips."""

import os
import re
import textwrap

import numpy as np
import pytest
from conftest import tiny_llama_config, token_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")))]
BLOCK = re.compile(
    r"(?:^[ ]*<!-- not run: (?P<why>[^>]*) -->\n)?^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M
)


def blocks(page: str) -> list[tuple[str, str | None]]:
    """(code, reason it is not run or None) of each python block of `page`."""
    text = open(os.path.join(ROOT, page)).read()
    return [(textwrap.dedent(m["code"]), m["why"]) for m in BLOCK.finditer(text)]


def _tokenizer(vocab=300):
    from jtrainer.cli.tasks import train_tokenizer

    texts = [f"def main():\n    return {i} + {i * 2}  # the answer\n" for i in range(200)]
    return train_tokenizer(texts, vocab)


def _class_rows(n, vocab=64):
    rng = np.random.RandomState(0)
    return [{"input_ids": rng.randint(0, vocab, 8), "labels": int(rng.randint(0, 2))} for _ in range(n)]


def _namespace(page: str) -> dict:
    """The names a page's snippets take as given (its prose says what they are), built tiny."""
    import jax
    import jax.numpy as jnp
    import transformers
    from flax import nnx

    import jtrainer
    from jtrainer import Trainer, TrainingArguments

    ns = {
        "jax": jax,
        "jnp": jnp,
        "nnx": nnx,
        "jtrainer": jtrainer,
        "Trainer": Trainer,
        "TrainingArguments": TrainingArguments,
        "DataCollatorForSeq2Seq": transformers.DataCollatorForSeq2Seq,
    }
    quick = dict(report_to="none", disable_tqdm=True, save_strategy="no", max_steps=1)
    if page == "README.md":
        ns.update(train_rows=token_rows(64, vocab=2048), eval_rows=token_rows(8, vocab=2048), tokenizer=_tokenizer())
    elif page == "docs/main-job.md":
        import torch

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=300)).save_pretrained("outputs/default")
        _tokenizer().save_pretrained("outputs/default")
    elif page == "docs/models.md":
        import torch

        torch.manual_seed(0)
        config = transformers.Qwen3Config(**tiny_llama_config(vocab_size=300).to_dict())
        transformers.Qwen3ForCausalLM(config).save_pretrained("path/to/local/qwen3")
        ns.update(
            args=TrainingArguments("out", **quick),
            ds=_class_rows(8, vocab=1000),
            path="path/to/local/qwen3",
            tokenizer=_tokenizer(),
        )
    elif page == "docs/training.md":
        from jtrainer.cli.tasks import ModelArguments, build_model

        tokenizer = _tokenizer()
        t5 = build_model(
            ModelArguments(
                task="seq2seq",
                model_type="t5",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
            ),
            len(tokenizer),
            {"pad_token_id": 0, "eos_token_id": 1},
            0,
        )
        pairs = [{"input_ids": tokenizer(f"def f{i}(): pass")["input_ids"], "labels": [5, 6, 1]} for i in range(8)]
        ns.update(
            model=jtrainer.models.LlamaForCausalLM.from_config(tiny_llama_config()),
            args=TrainingArguments("out", **quick),
            train=token_rows(8),
            val=token_rows(4),
            t5=t5,
            tokenizer=tokenizer,
            test=[{"input_ids": p["input_ids"]} for p in pairs[:4]],
            class_weights=jnp.ones(64),
        )
        ns.update(train=token_rows(8))
    elif page == "docs/performance.md":
        ns.update(tokenizer=_tokenizer(), texts=[f"def f{i}(): return {i}" for i in range(20)])
    elif page == "docs/integrations.md":
        ns["trainer"] = Trainer(
            model_init=lambda: jtrainer.models.LlamaForCausalLM.from_config(tiny_llama_config()),
            args=TrainingArguments("out", **quick, eval_strategy="no"),
            train_dataset=token_rows(8),
            eval_dataset=token_rows(4),
        )
    return ns


def test_every_page_has_its_code_found():
    found = {page: blocks(page) for page in PAGES}
    assert len(found["README.md"]) >= 2 and sum(len(b) for b in found.values()) >= 12
    assert all(why.strip() for b in found.values() for _, why in b if why is not None)


def _runnable(page: str) -> bool:
    return any(why is None for _, why in blocks(page))


@pytest.mark.parametrize("page", [page for page in PAGES if _runnable(page)])
def test_the_code_of_the_page_runs(page, tmp_path, monkeypatch):
    """Every block not marked `not run`, in order (pages without python code, or with none runnable here, have
    nothing to run: sizing, accelerators and the gs:// example)."""
    monkeypatch.chdir(tmp_path)
    ns = _namespace(page)
    for source, why in blocks(page):
        if why is None:
            exec(compile(source, f"{page} snippet", "exec"), ns)
