"""Shared fixtures: tiny models and datasets built locally (nothing is downloaded)."""

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests count compilations: no persistent compilation cache unless a test turns one on.
os.environ.setdefault("JTRAINER_COMPILATION_CACHE_DIR", "none")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))

# Tests do not measure speed: compile fast.
jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True)
def _fresh_compiled_steps():
    """Each test compiles its own steps: a step cached by another test holds that test's closures."""
    import jtrainer

    jtrainer.clear_compiled_steps()
    yield
    jtrainer.clear_compiled_steps()


@contextlib.contextmanager
def count_compiles(name: str = "train_step"):
    """Counts XLA compilations of jitted functions called `name` in the block (JAX's own compile log)."""
    compiles: list[str] = []

    class Counter(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith(f"Finished XLA compilation of jit({name})"):
                compiles.append(message)

    logger, handler = logging.getLogger("jax._src.dispatch"), Counter()
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield compiles
    finally:
        logger.removeHandler(handler)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def scratch_dir() -> str:
    """A fresh folder for a run whose output_dir the test never reads (removed at exit): runs in parallel test
    workers must not share one, since a training run locks its output_dir."""
    path = tempfile.mkdtemp(prefix="jtrainer-test-")
    atexit.register(shutil.rmtree, path, True)
    return path


def short_run_args(out=None, **over):
    """TrainingArguments of a 3-step run logging every step (in order, no saves, no reports); `over` overrides."""
    from jtrainer import TrainingArguments

    kw = dict(
        output_dir=str(out or scratch_dir()),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=3,
        train_sampling_strategy="sequential",
    )
    kw.update(over)
    return TrainingArguments(**kw)


def token_rows(n, length=16, vocab=64, seed=0, ragged_labels=False):
    """n rows of random tokens; with ragged_labels some label positions are -100 (uneven counts per row)."""
    rng = np.random.RandomState(seed)
    rows = []
    for i in range(n):
        ids = rng.randint(0, vocab, length)
        labels = ids.copy()
        if ragged_labels:
            labels[: rng.randint(0, length - 2)] = -100
        rows.append({"input_ids": ids, "attention_mask": np.ones(length, np.int64), "labels": labels})
    return rows


def torch_rows(rows):
    """The same rows as a torch Dataset, for transformers.Trainer."""
    import torch

    class TorchRows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {k: torch.tensor(v) for k, v in rows[i].items()}

    return TorchRows()


@pytest.fixture
def llama_config():
    return tiny_llama_config()


def bridged_loss_and_grads(torch_model, **inputs):
    """A torch model's loss on `inputs` (torch tensors) and its trainable parameters' gradients by torch name,
    computed through the bridge (eval mode, jitted), as floats and numpy arrays."""
    import jax.numpy as jnp
    from flax import nnx

    from jtrainer.bridge.module import TorchModel

    bridged = TorchModel(torch_model)
    bridged.deterministic = True
    graphdef, params, rest = nnx.split(bridged, nnx.Param, ...)
    arrays = {k: jnp.asarray(v.numpy()) for k, v in inputs.items()}

    def loss_of(params):
        return nnx.merge(graphdef, params, rest)(**arrays)["loss"]

    loss, grads = jax.jit(jax.value_and_grad(loss_of))(params)
    return float(loss), {".".join(map(str, path[1:])): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}


def eval_args(out, **over):
    """TrainingArguments of a short run that evaluates in batches of 4 (logging every step, no saves)."""
    from jtrainer import TrainingArguments

    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    kw.update(over)
    return TrainingArguments(**kw)


def class_rows(n, seed=0):
    """Three-class rows whose tokens tell the class (Classifier learns them), with an unused text column."""
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 3)
        ids = rng.randint(label * 20, label * 20 + 20, 6)
        rows.append({"input_ids": ids, "label": label, "unused_text": "x"})
    return rows


def accuracy(pred):
    """compute_metrics: the accuracy of argmax predictions."""
    return {"accuracy": float(np.mean(np.argmax(pred.predictions, -1) == pred.label_ids))}


# User models: flax.nnx modules that are not jtrainer families.
class Classifier(nnx.Module):
    """A user model that returns logits only, as a dict: the Trainer computes the loss."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None):
        return {"logits": self.head(self.embed(input_ids).mean(axis=1))}


class WithDropout(nnx.Module):
    """A user model with dropout, returning logits only."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.head(self.drop(self.embed(input_ids)))}


def side_by_side_args(cls, out, **over):
    """HF's TrainingArguments class or jtrainer's (`cls`), with the arguments of the side-by-side runs."""
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        num_train_epochs=2,
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        optim="adamw_torch",
    )
    kw.update(over)
    return cls(**kw)


def spawn_checkpoint_job(out, *args, env=None):
    """tests/jobs/ckpt_job.py in a subprocess (stderr piped, for the messages of a failure)."""
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "ckpt_job.py"),
            str(out),
            *map(str, args),
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def wait_until(condition, proc, what, timeout=180):
    """Poll `condition()` while `proc` runs; fail with its stderr if it ends first, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.1)
