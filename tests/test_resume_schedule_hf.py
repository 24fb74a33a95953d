"""Resuming with changed arguments (a longer run, another warmup, rate or clipping) gives transformers.Trainer's
learning rates, losses and weights when it resumes the same checkpoint."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from conftest import tiny_llama_config, token_rows, torch_rows  # noqa: E402


def _kwargs(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_steps=6,
        save_steps=6,
        logging_steps=1,
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        optim="adamw_torch",
        weight_decay=0.1,
    )
    kw.update(over)
    return kw


CASES = {
    # HF: the first resumed update applies the rate saved with the optimizer (0 at the old end), then the new one.
    "longer_max_steps": ({}, {"max_steps": 10}),
    # Epochs instead of steps, a warmup ratio, cosine; the new learning_rate is not taken (torch keeps the saved
    # scheduler's base rate) while the new max_grad_norm is.
    "epochs_rate_and_clipping": (
        {"max_steps": -1, "num_train_epochs": 1, "warmup_steps": 0.25, "lr_scheduler_type": "cosine"},
        {
            "max_steps": -1,
            "num_train_epochs": 2,
            "warmup_steps": 0.25,
            "lr_scheduler_type": "cosine",
            "learning_rate": 1e-3,
            "max_grad_norm": 0.05,
        },
    ),
}


def _logs(state):
    return [(h["step"], h["learning_rate"], h["loss"]) for h in state.log_history if "loss" in h]


@pytest.mark.parametrize("case", CASES)
def test_resume_with_new_arguments_as_transformers(tmp_path, case):
    import transformers

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    first, second = CASES[case]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "init")
    rows = token_rows(24)

    def hf_run(**over):
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "init")
        args = transformers.TrainingArguments(**_kwargs(tmp_path / "hf", **over))
        return transformers.Trainer(model=model, args=args, train_dataset=torch_rows(rows))

    def jt_run(**over):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path / "init"))
        return Trainer(model=model, args=TrainingArguments(**_kwargs(tmp_path / "jt", **over)), train_dataset=rows)

    hf_run(**first).train()
    hf = hf_run(**second)
    hf.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-6"))
    jt_run(**first).train()
    jt = jt_run(**second)
    jt.train(resume_from_checkpoint=str(tmp_path / "jt" / "checkpoint-6"))

    hf_logs, jt_logs = _logs(hf.state), _logs(jt.state)
    assert [s for s, _, _ in jt_logs] == [s for s, _, _ in hf_logs] and len(hf_logs) > 6
    np.testing.assert_allclose([r for _, r, _ in jt_logs], [r for _, r, _ in hf_logs], rtol=1e-7, atol=0)
    np.testing.assert_allclose([x for _, _, x in jt_logs], [x for _, _, x in hf_logs], rtol=2e-5)
    from jtrainer.models.hf_io import to_hf_state_dict

    ref = {k: v.detach().numpy() for k, v in hf.model.state_dict().items()}
    got = to_hf_state_dict(jt.model)
    assert got and set(got) <= set(ref)
    for name, value in got.items():
        np.testing.assert_allclose(value, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
