"""A training run for the checkpoint/preemption tests, in its own process (to be killed or sent SIGTERM).

    python tests/jobs/ckpt_job.py OUT_DIR MAX_STEPS SAVE_STEPS EVAL(0|1) [MESH_JSON GLOBAL_BATCH [RESUME_FROM]]
Touches OUT_DIR/step (the global step) after every step, and OUT_DIR/evaluating during evaluations;
with CKPT_JOB_RAISE_AT_STEP=N a callback raises after step N; with CKPT_JOB_SAVE_MODEL=1 save_model() writes
OUT_DIR/final at the end; CKPT_JOB_JIT=1 sets enable_jit_checkpoint; with CKPT_JOB_DISK_AT_STEP=N the disk fails after
step N: CKPT_JOB_DISK=full (no file may grow past 1 KiB: EFBIG, as ENOSPC) or readonly (OUT_DIR loses write access).
"""

import contextlib
import os
import resource
import sys
import time


def _obey_file_permissions() -> None:
    """Root ignores file permissions: drop the capabilities that let it (DAC_OVERRIDE, DAC_READ_SEARCH, FOWNER)
    from this process, before any thread exists (threads inherit them), so a read-only folder is read-only."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    override = (1 << 1) | (1 << 2) | (1 << 3)
    data[0].effective &= ~override
    data[0].permitted &= ~override
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


if __name__ == "__main__" and os.environ.get("CKPT_JOB_DISK") == "readonly" and os.geteuid() == 0:
    _obey_file_permissions()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__":  # jtrainer runs without torch, as on a TPU VM (transformers would import it: slower)
    sys.modules["torch"] = None
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)

from conftest import tiny_llama_config, token_rows  # noqa: E402

from jtrainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


class Marker(TrainerCallback):
    def __init__(self, out):
        self.out = out

    def on_step_end(self, args, state, control, **kwargs):
        if "://" in self.out:  # an object store (the cloud-storage tests): no marker files
            return
        with contextlib.suppress(OSError), open(os.path.join(self.out, "step"), "w") as f:
            f.write(str(state.global_step))
        if str(state.global_step) == os.environ.get("CKPT_JOB_RAISE_AT_STEP"):
            raise RuntimeError(f"a callback failed at step {state.global_step}")
        if str(state.global_step) == os.environ.get("CKPT_JOB_DISK_AT_STEP"):
            committed = os.path.join(self.out, f"checkpoint-{state.global_step - 1}", "commit_success.json")
            while not os.path.exists(committed):  # the disk fails after the previous checkpoint is committed
                time.sleep(0.05)
            if os.environ["CKPT_JOB_DISK"] == "full":
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            else:
                for folder, _, _ in os.walk(self.out):
                    os.chmod(folder, 0o555)

    def on_prediction_step(self, args, state, control, **kwargs):
        if "://" not in self.out:
            open(os.path.join(self.out, "evaluating"), "w").close()


PAUSE_ENV = "CKPT_JOB_PAUSE_BEFORE_COMMIT"  # "SECONDS" (every save) or "STEP:SECONDS" (that step's save)


def pause_before_commit(folder: str, step: int) -> None:
    """checkpoint.before_commit for PAUSE_ENV: mark the folder `paused` while waiting, so a test can kill us there."""
    import time

    from jtrainer.core import storage

    at, _, seconds = os.environ.get(PAUSE_ENV, "").rpartition(":")
    if seconds and (not at or int(at) == step):
        storage.write_text(storage.join(folder, "paused"), "")
        time.sleep(float(seconds))
        storage.remove(storage.join(folder, "paused"))  # not part of the checkpoint its manifest lists


def make_trainer(out, max_steps, save_steps, evaluate, mesh_shape=None, global_batch=4):
    if "://" not in out:
        os.makedirs(out, exist_ok=True)
    data_parallel = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) if mesh_shape else jax.device_count()
    args = TrainingArguments(
        output_dir=out,
        mesh_shape=mesh_shape,
        per_device_train_batch_size=global_batch // data_parallel,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=3,
        enable_jit_checkpoint=bool(os.environ.get("CKPT_JOB_JIT")),
    )
    return Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=args,
        # Five full global batches an epoch: runs on other meshes see the same batches (a ragged last batch
        # would be completed from the first rows on several data shards, as HF's distributed sampler does).
        train_dataset=token_rows(5 * global_batch, length=16, ragged_labels=True),
        eval_dataset=token_rows(200, length=16, seed=9) if evaluate else None,
        callbacks=[Marker(out)],
    )


if __name__ == "__main__":
    import json
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when started in background
    from jtrainer.checkpointing import checkpoint

    checkpoint.before_commit = pause_before_commit

    out, max_steps, save_steps, evaluate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    mesh = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 4
    resume = sys.argv[7] if len(sys.argv) > 7 else None
    trainer = make_trainer(out, max_steps, save_steps, evaluate, mesh or None, batch)
    trainer.train(resume_from_checkpoint=resume)
    if os.environ.get("CKPT_JOB_SAVE_MODEL"):  # the export gathered at the end, beside the checkpoints' own
        trainer.save_model(os.path.join(out, "final") if "://" not in out else out + "/final")
    if jax.process_index() == 0:
        from jtrainer.core import storage

        losses = {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
        storage.write_text(storage.join(out, "losses.json"), json.dumps(losses))
