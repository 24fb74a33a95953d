"""The process-wide caches of jitted steps: bounded, least recently used first out, and clearable."""

from conftest import short_run_args, tiny_llama_config, token_rows


def test_the_cache_keeps_the_most_recently_used_entries():
    from jtrainer.runtime.compiled_steps import StepCache

    cache = StepCache(max_entries=2)
    cache["a"], cache["b"] = 1, 2
    assert cache["a"] == 1  # "a" is now the most recently used
    cache["c"] = 3
    assert "b" not in cache and "a" in cache and "c" in cache and len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def test_a_trainer_step_is_shared_until_cleared():
    import jtrainer
    from jtrainer import Trainer
    from jtrainer.models.llama import LlamaForCausalLM
    from jtrainer.runtime import compiled_steps

    def run():
        model = LlamaForCausalLM.from_config(tiny_llama_config())
        trainer = Trainer(model=model, args=short_run_args(max_steps=1), train_dataset=token_rows(4))
        trainer.train()
        return trainer._run.train_step

    first = run()
    assert len(compiled_steps.TRAIN_STEPS) == 1 and run() is first  # the same structure reuses the jitted step
    jtrainer.clear_compiled_steps()
    assert len(compiled_steps.TRAIN_STEPS) == 0 and len(compiled_steps.EVAL_STEPS) == 0
    assert run() is not first
