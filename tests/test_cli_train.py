"""`jtrainer train`, the main job, end to end: it trains, evaluates, saves and samples, and refuses bad values."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


def test_main_job_end_to_end(tmp_path, capsys):
    import transformers

    from jtrainer.cli import main

    out = tmp_path / "run"
    main(
        [
            "train",
            "configs/default.yaml",
            "--max_steps",
            "4",
            "--max_chars",
            "60000",
            "--hidden_size",
            "32",
            "--intermediate_size",
            "64",
            "--num_hidden_layers",
            "1",
            "--block_size",
            "32",
            "--tokenizer_vocab_size",
            "300",
            "--logging_steps",
            "1",
            "--sample_tokens",
            "4",
            "--output_dir",
            str(out),
            "--disable_tqdm",
            "true",
        ]
    )
    printed = capsys.readouterr().out
    assert "held-out perplexity" in printed and "sample:" in printed
    model = transformers.LlamaForCausalLM.from_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("def main():", return_tensors="pt")["input_ids"]
    ours = LlamaForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids.numpy())).logits), expected, atol=1e-4)


def test_main_job_rejects_bad_values(capsys):
    from jtrainer.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--learning_rate", "fast"])
    with pytest.raises(SystemExit):
        main(["train", "--optim", "no_such_optimizer"])
    assert main(["train", "--optim", "galore_adamw"]) == 1
    assert "'galore_adamw' is not supported by jtrainer" in capsys.readouterr().err


def test_a_diverged_run_exports_nothing_and_says_so(tmp_path, capsys):
    """A learning rate that sends the weights to NaN: no all-NaN export, no perplexity, exit code 1, one line."""
    from jtrainer.cli import main

    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"f{i}.txt").write_text(" ".join(f"w{(i + j) % 30}" for j in range(400)))
    out = tmp_path / "run"
    small = "--hidden_size 32 --intermediate_size 64 --num_hidden_layers 1 --block_size 16 --tokenizer_vocab_size 300"
    argv = ["train", "--text_dir", str(text), "--output_dir", str(out), *small.split(), "--disable_tqdm", "true"]
    assert main([*argv, "--max_steps", "3", "--learning_rate", "1e12", "--max_grad_norm", "0"]) == 1
    printed = capsys.readouterr()
    said = [line for line in printed.err.splitlines() if line.startswith("jtrainer train: ")]
    assert len(said) == 1 and "training diverged" in said[0], printed.err[-3000:]
    assert "perplexity" not in printed.out and not (out / "model.safetensors").exists()
