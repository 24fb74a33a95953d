"""Resuming a transformers.Trainer (torch) checkpoint-N: jtrainer continues the run as torch's own resume does
(weights, AdamW moments, schedule, trainer state), checked against transformers.Trainer resuming the same folder."""

import shutil
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from conftest import scratch_dir, tiny_llama_config, token_rows, torch_rows  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

FAMILIES = {
    "llama": (lambda: transformers.LlamaForCausalLM(tiny_llama_config()), "LlamaForCausalLM"),
    # Tied embeddings (torch lists the table once), Conv1D weights stored [in, out], LayerNorm excluded by type;
    # no dropout (torch's and jax's masks differ).
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=64,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "GPT2LMHeadModel",
    ),
}


def _kwargs(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=1,
        lr_scheduler_type="linear",
        max_steps=4,
        save_steps=2,
        logging_steps=1,
        max_grad_norm=1.0,
        weight_decay=0.1,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
    )
    kw.update(over)
    return kw


def _hf_checkpoint(tmp_path, family, **over):
    """transformers.Trainer trains `family` 4 steps saving every 2; returns its output folder."""
    build, _ = FAMILIES[family]
    torch.manual_seed(0)
    out = tmp_path / "hf"
    args = transformers.TrainingArguments(**_kwargs(out, **over))
    transformers.Trainer(model=build(), args=args, train_dataset=torch_rows(token_rows(24))).train()
    return out


def _jtrainer(folder, family, **over):
    import jtrainer.models as models
    from jtrainer import Trainer, TrainingArguments

    model = getattr(models, FAMILIES[family][1]).from_pretrained(str(folder))
    args = TrainingArguments(**_kwargs(scratch_dir(), save_strategy="no", **over))
    return Trainer(model=model, args=args, train_dataset=token_rows(24))


def _logs(history):
    return [(h["step"], h["learning_rate"], h["loss"], h["grad_norm"]) for h in history if "loss" in h]


@pytest.mark.parametrize("family", FAMILIES)
def test_resuming_a_torch_checkpoint_continues_as_transformers(tmp_path, family):
    hf_out = _hf_checkpoint(tmp_path, family)
    folder = hf_out / "checkpoint-2"
    ours = _jtrainer(folder, family)
    ours.train(resume_from_checkpoint=str(folder))

    theirs = transformers.TrainerState.load_from_json(str(hf_out / "checkpoint-4" / "trainer_state.json"))
    # The resumed log_history is the checkpoint's (steps 1-2) followed by the two new steps.
    expected, got = _logs(theirs.log_history), _logs(ours.state.log_history)
    assert [e[0] for e in got] == [1, 2, 3, 4]
    for (step, lr, loss, norm), (g_step, g_lr, g_loss, g_norm) in zip(expected, got, strict=True):
        assert g_step == step and g_lr == pytest.approx(lr, rel=1e-12)
        assert g_loss == pytest.approx(loss, rel=1e-5) and g_norm == pytest.approx(norm, rel=1e-4)
    assert ours.state.global_step == 4
    want = load_file(str(hf_out / "checkpoint-4" / "model.safetensors"))
    from jtrainer.models import hf_io

    have = hf_io.to_hf_state_dict(ours.model)
    assert set(have) == set(want)
    for name in want:
        np.testing.assert_allclose(have[name], want[name], rtol=1e-4, atol=2e-6, err_msg=name)


def test_a_longer_resume_follows_transformers_new_schedule(tmp_path):
    """Resumed with max_steps=6: torch applies the saved rate once, then this run's schedule."""
    hf_out = _hf_checkpoint(tmp_path, "llama")
    folder = hf_out / "checkpoint-2"
    shutil.rmtree(hf_out / "checkpoint-4")
    args = transformers.TrainingArguments(**_kwargs(hf_out, max_steps=6, save_steps=100))
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    hf = transformers.Trainer(model=model, args=args, train_dataset=torch_rows(token_rows(24)))
    hf.train(resume_from_checkpoint=str(folder))

    ours = _jtrainer(folder, "llama", max_steps=6)
    ours.train(resume_from_checkpoint=str(folder))
    expected, got = _logs(hf.state.log_history), _logs(ours.state.log_history)
    assert [e[0] for e in got] == list(range(1, 7))
    for (step, lr, loss, _), (_, g_lr, g_loss, _) in zip(expected, got, strict=True):
        assert g_lr == pytest.approx(lr, rel=1e-12), step
        assert g_loss == pytest.approx(loss, rel=1e-5), step


def test_torch_checkpoints_are_found_and_what_cannot_continue_is_refused(tmp_path, monkeypatch):
    from jtrainer import get_last_checkpoint
    from jtrainer.checkpointing import checkpoint
    from jtrainer.checkpointing.hf_checkpoint import HFCheckpointError

    hf_out = _hf_checkpoint(tmp_path, "llama")
    assert get_last_checkpoint(str(hf_out)) == str(hf_out / "checkpoint-4")  # as HF's get_last_checkpoint
    folder = hf_out / "checkpoint-2"

    with pytest.raises(HFCheckpointError, match="optim=sgd: jtrainer resumes torch's AdamW state only"):
        _jtrainer(folder, "llama", optim="sgd").train(resume_from_checkpoint=str(folder))
    # Another schedule cannot give the rate torch saved for the next update: refused, not approximated.
    with pytest.raises(HFCheckpointError, match="lr_scheduler_type=cosine .* resume with the schedule arguments"):
        _jtrainer(folder, "llama", lr_scheduler_type="cosine").train(resume_from_checkpoint=str(folder))
    # Without torch the pickles cannot be read: the error says so and what to do instead.
    trainer = _jtrainer(folder, "llama")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(HFCheckpointError, match="torch is not installed.*from_pretrained"):
        trainer.train(resume_from_checkpoint=str(folder))
    monkeypatch.undo()

    (folder / "optimizer.pt").unlink()
    (folder / "rng_state.pth").unlink()
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="transformers.Trainer's.* lacks optimizer.pt"):
        checkpoint.verify_checkpoint(str(folder))
    shutil.rmtree(hf_out / "checkpoint-4")
    assert get_last_checkpoint(str(hf_out)) is None


class _RunsCode:
    def __reduce__(self):
        return (print, ("a pickle that runs code",))


def test_a_pickle_that_would_run_code_is_skipped_naming_the_file(tmp_path):
    from jtrainer import get_last_checkpoint
    from jtrainer.checkpointing import checkpoint

    hf_out = _hf_checkpoint(tmp_path, "llama")
    torch.save({"python": _RunsCode()}, hf_out / "checkpoint-4" / "rng_state.pth")
    with pytest.raises(
        checkpoint.CheckpointIntegrityError, match=r"rng_state.pth holds objects .*weights_only.*would call print"
    ):
        checkpoint.verify_checkpoint(str(hf_out / "checkpoint-4"))
    assert get_last_checkpoint(str(hf_out)) == str(hf_out / "checkpoint-2")
    trainer = _jtrainer(hf_out / "checkpoint-2", "llama")
    trainer.train(resume_from_checkpoint=get_last_checkpoint(str(hf_out)))
    assert trainer.state.global_step == 4
