"""jtrainer.runtime.startup: importing jtrainer changes nothing outside it; `jtrainer.initialize()` (called by
TrainingArguments, the Trainer and the CLI) applies the start-up effects once."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ, timeout=300
    )


def test_import_has_no_effect_and_the_arguments_initialize(tmp_path):
    done = _run(
        """
        import jax
        import jtrainer
        from jtrainer.runtime import startup
        assert jax.config.jax_compilation_cache_dir is None, "import set the compilation cache"
        assert not startup._initialized
        jtrainer.TrainingArguments(output_dir="out", report_to="none")
        assert startup._initialized
        print("cache", jax.config.jax_compilation_cache_dir)
        """,
        JTRAINER_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"cache {tmp_path / 'cache'}" in done.stdout


def test_building_a_jtrainer_model_first_initializes():
    """Scripts that build the model before the arguments (the README's quickstart) start up there."""
    done = _run(
        """
        import sys
        sys.path.insert(0, "tests")
        from conftest import tiny_llama_config
        from jtrainer.models import LlamaForCausalLM
        from jtrainer.runtime import startup
        assert not startup._initialized
        LlamaForCausalLM.from_config(tiny_llama_config())
        print("initialized", startup._initialized)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initialized True" in done.stdout


def test_a_process_of_many_that_used_a_device_first_gets_one_line():
    done = _run(
        """
        import jax.numpy as jnp
        import jtrainer
        jnp.ones(3).block_until_ready()  # a device used before start-up
        jtrainer.initialize()
        """,
        JTRAINER_COORDINATOR="127.0.0.1:1",
        JTRAINER_NUM_PROCESSES="2",
        JTRAINER_PROCESS_ID="0",
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "call jtrainer.initialize() (or create the TrainingArguments) before building the model" in last, last


# The modules whose own import needs torch (the torch side of the bridge); every other module loads without it.
TORCH_MODULES = {
    "jtrainer.bridge.aliasing",
    "jtrainer.bridge.attention",
    "jtrainer.bridge.chunked_loss",
    "jtrainer.bridge.custom_autograd",
    "jtrainer.bridge.linear",
    "jtrainer.bridge.module",
    "jtrainer.bridge.torch_code",
    "jtrainer.bridge.torch_models",
    "jtrainer.bridge.torchax_compat",
    "jtrainer.bridge.trained",
}


def test_import_loads_no_torch_until_torch_code_arrives(tmp_path):
    """`import jtrainer`, the public names and every module outside the bridge's torch side and jtrainer.trl load
    no torch, peft, accelerate, bitsandbytes or TRL (installed here: the test extras); a native model trains
    without them; a transformers.Trainer imported afterwards still gets torch, peft and accelerate where it needs
    them."""
    done = _run(
        f"""
        import importlib, os, pkgutil, sys
        sys.path.insert(0, "tests")
        torch_side = ("torch", "peft", "accelerate", "bitsandbytes", "torchax", "trl")
        loaded = lambda: sorted({{m.split(".")[0] for m in sys.modules}} & set(torch_side))
        import jtrainer
        assert loaded() == [], ("import jtrainer", loaded())
        assert "jax" not in sys.modules  # the public names load on first use
        from jtrainer import *  # noqa
        import jtrainer.cli
        for info in pkgutil.walk_packages(jtrainer.__path__, "jtrainer."):
            if info.name.startswith("jtrainer.trl."):  # TRL's trainers: TRL imports torch
                continue
            if info.name not in {sorted(TORCH_MODULES)!r} and not info.name.endswith("__main__"):
                importlib.import_module(info.name)
        assert loaded() == [], ("the modules", loaded())
        from conftest import tiny_llama_config
        from jtrainer import Trainer, TrainingArguments
        from jtrainer.models import LlamaForCausalLM
        import numpy as np
        import jax, jax.numpy as jnp
        from flax import nnx
        model = LlamaForCausalLM.from_config(tiny_llama_config())
        rows = [{{"input_ids": np.arange(8) % 50, "labels": np.arange(8) % 50}}] * 4
        args = TrainingArguments(output_dir="{{}}".format(os.environ["OUT"]), max_steps=1, report_to="none",
                                 per_device_train_batch_size=2, save_strategy="no")
        Trainer(model=model, args=args, train_dataset=rows).train()
        assert loaded() == [], ("a native run", loaded())
        import json
        from jtrainer.models import AutoModelForCausalLM
        folder = os.path.join(os.environ["OUT"], "saved")
        model.save_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(saved, dtype="bfloat16"), f)  # as transformers writes it (a name torch would read)
        assert LlamaForCausalLM.from_pretrained(folder).config.dtype == "bfloat16"
        again = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
        assert next(iter(jax.tree.leaves(nnx.state(again, nnx.Param)))).dtype == jnp.bfloat16
        assert loaded() == [], ("loading a saved model", loaded())
        from transformers import Trainer as HFTrainer  # a side-by-side script: transformers' own Trainer
        from transformers.trainer_utils import _is_peft_model
        from transformers.training_args import TrainingArguments as HFArgs
        import torch, peft
        hf_args = HFArgs(output_dir=os.environ["OUT"], report_to="none", use_cpu=True)
        assert hf_args.device == torch.device("cpu") and hf_args.distributed_state is not None
        lora = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), peft.LoraConfig(target_modules=["0"]))
        assert _is_peft_model(lora) and not _is_peft_model(torch.nn.Linear(2, 2))
        print("ok")
        """,
        OUT=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok" in done.stdout


def test_a_bridged_run_loads_no_transformers_trainer_or_its_packages(tmp_path):
    """A transformers model trained through the bridge imports torch and torchax, but not transformers.trainer nor
    what it brings (peft, bitsandbytes: ~1.4 s and ~140 MB of the bridged start; accelerate comes with
    transformers' modeling code itself)."""
    if importlib.util.find_spec("torchax") is None:  # (importorskip would import it here, without the bridge's fixes)
        pytest.skip("torchax is not installed")
    done = _run(
        """
        import os, sys
        sys.path.insert(0, "tests")
        import numpy as np, transformers
        from conftest import tiny_llama_config
        from jtrainer import Trainer, TrainingArguments
        model = transformers.LlamaForCausalLM(tiny_llama_config())
        rows = [{"input_ids": np.arange(8) % 50, "labels": np.arange(8) % 50}] * 4
        args = TrainingArguments(output_dir=os.environ["OUT"], max_steps=1, report_to="none",
                                 per_device_train_batch_size=2, save_strategy="no")
        Trainer(model=model, args=args, train_dataset=rows).train()
        heavy = ("transformers.trainer", "peft", "bitsandbytes")
        loaded = [m for m in heavy if m in sys.modules]
        assert "torchax" in sys.modules and not loaded, loaded
        print("ok")
        """,
        OUT=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok" in done.stdout


def test_transformers_modules_imported_without_torch_bind_what_they_would_with_it():
    """Every name the host modules (and what they import) bind with torch imported first is bound after `import
    jtrainer` too (a stand-in where torch would be needed), and a field's type is the same class."""
    dump = """
        import json, sys, types
        from jtrainer.core import hf_host
        {first}
        for name in hf_host.HOST_MODULES:
            __import__(name)
        found = {{n: sorted(k for k in vars(m) if not k.startswith("__") and f"{{n}}.{{k}}" not in sys.modules)
                 for n, m in sorted(sys.modules.items())
                 if n.startswith("transformers") and isinstance(m, types.ModuleType)
                 and not type(m).__name__ == "_LazyModule"}}
        import transformers.training_args as t
        field = t.TrainingArguments.__dataclass_fields__["parallelism_config"].type
        found["field"] = [str(getattr(a, "__name__", a)) for a in getattr(field, "__args__", (field,))]
        print(json.dumps(found))
    """
    plain = _run(dump.format(first="import torch, transformers.trainer  # torch first: nothing deferred"))
    deferred = _run(dump.format(first="import jtrainer"))
    assert plain.returncode == 0 and deferred.returncode == 0, (plain.stderr[-2000:], deferred.stderr[-2000:])
    with_torch, without = json.loads(plain.stdout), json.loads(deferred.stdout)
    missing = {
        name: sorted(set(with_torch[name]) - set(names))
        for name, names in without.items()
        if name in with_torch and set(with_torch[name]) - set(names)
    }
    assert missing == {}
    assert without["field"] == with_torch["field"] == ["ParallelismConfig", "NoneType"]
