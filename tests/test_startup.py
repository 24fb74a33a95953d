"""jtrainer.runtime.startup: importing jtrainer changes nothing outside it; `jtrainer.initialize()` (called by
TrainingArguments, the Trainer and the CLI) applies the start-up effects once."""

import os
import subprocess
import sys
import textwrap


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
