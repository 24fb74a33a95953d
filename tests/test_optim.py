"""Schedules equal HF's lr lambdas step by step; every supported optimizer name builds and trains."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jtrainer import TrainingArguments
from jtrainer.numerics.opt_state import find_hyperparams
from jtrainer.numerics.optim import SUPPORTED_OPTIMIZERS, decay_mask, make_optimizer, parse_optim_args
from jtrainer.numerics.schedules import GreedyScheduler, PlateauScheduler, make_schedule, schedule_multiplier

SCHEDULES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-5}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-4}),
    ("warmup_stable_decay", {"num_decay_steps": 7, "decay_type": "1-sqrt", "min_lr_ratio": 0.05}),
    ("warmup_stable_decay", {"num_decay_steps": 5, "warmup_type": "cosine", "decay_type": "linear"}),
]


@pytest.mark.parametrize("name, kwargs", SCHEDULES)
def test_schedule_matches_hf(name, kwargs):
    torch = pytest.importorskip("torch")
    from transformers.optimization import get_scheduler

    base, warmup, total = 1e-3, 5, 30
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base)
    sched = get_scheduler(name, opt, warmup, total, scheduler_specific_kwargs=dict(kwargs))
    ours = make_schedule(name, base, warmup, total, dict(kwargs))
    for step in range(total + 3):
        np.testing.assert_allclose(float(ours(step)), sched.get_last_lr()[0], rtol=1e-5, atol=1e-10, err_msg=str(step))
        opt.step()
        sched.step()


def test_plateau_matches_torch():
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    ours, lr = PlateauScheduler(patience=1, factor=0.5), 1.0
    for metric in [5, 4, 4, 4, 4, 3, 3, 3, 3]:
        ref.step(metric)
        lr = ours.step(metric, lr)
        assert lr == pytest.approx(opt.param_groups[0]["lr"])


@pytest.mark.parametrize("warmup", [0, 5, 0.2])
@pytest.mark.parametrize("name, kwargs", SCHEDULES)
def test_host_rate_is_hf_float64(name, kwargs, warmup):
    """The logged rate: HF's scheduler value in float64 (1e-7 relative), warmup as a count or a ratio."""
    torch = pytest.importorskip("torch")
    from transformers.optimization import get_scheduler

    from jtrainer.numerics.schedules import host_learning_rate

    base, total = 3e-4, 30
    hf_args = __import__("transformers").TrainingArguments("o", warmup_steps=warmup, report_to="none")
    ours_warmup = TrainingArguments("o", warmup_steps=warmup, report_to="none").get_warmup_steps(total)
    assert ours_warmup == hf_args.get_warmup_steps(total)
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([param], lr=base)
    sched = get_scheduler(name, opt, hf_args.get_warmup_steps(total), total, scheduler_specific_kwargs=dict(kwargs))
    for step in range(total + 3):
        ref = sched.get_last_lr()[0]
        assert host_learning_rate(name, base, step, ours_warmup, total, kwargs) == pytest.approx(ref, rel=1e-7, abs=0)
        opt.step()
        sched.step()


def test_logged_rates_are_hf_float64(tmp_path):
    """End to end: a run's logged learning_rate equals HF's float64 schedule, not the device's float32."""
    pytest.importorskip("torch")
    import torch
    from conftest import short_run_args, tiny_llama_config, token_rows
    from transformers.optimization import get_scheduler

    from jtrainer import Trainer
    from jtrainer.models import LlamaForCausalLM

    args = short_run_args(
        tmp_path,
        max_steps=12,
        lr_scheduler_type="cosine_with_restarts",
        warmup_steps=0.25,
        learning_rate=3e-3,
        lr_scheduler_kwargs={"num_cycles": 2},
    )
    trainer = Trainer(model=LlamaForCausalLM.from_config(tiny_llama_config()), args=args, train_dataset=token_rows(48))
    trainer.train()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    sched = get_scheduler("cosine_with_restarts", opt, 3, 12, scheduler_specific_kwargs={"num_cycles": 2})
    expected = []
    for _ in range(12):
        expected.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    np.testing.assert_allclose(logged, expected, rtol=1e-7, atol=0)
    assert any(float(np.float32(e)) != e for e in expected)  # float32 rounding would show
    # HF's groups hold the next update's rate (the scheduler stepped after the last update), one per group.
    assert trainer.get_learning_rates() == [pytest.approx(sched.get_last_lr()[0], rel=1e-12)] * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(patience=1, factor=0.5, min_lr=0.1, reset_start=2),
        dict(patience=0, factor=0.8, cooldown=1, warmup=2, threshold_mode="rel", threshold=0.01, max_lr=1.5),
        dict(patience=1, factor=0.5, smooth=True, window_size=3, mode="max"),
    ],
)
def test_greedy_matches_transformers(kwargs):
    torch = pytest.importorskip("torch")
    from transformers.optimization import GreedyLR

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    ref = GreedyLR(opt, **kwargs)
    ours, lr, seen = GreedyScheduler(initial_lr=1.0, **kwargs), 1.0, [1.0]
    sign = -1 if kwargs.get("mode") == "max" else 1  # improving, then flat, then improving again
    metrics = [sign * m for m in [5, 4, 3, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 0.5, 0.4, 0.3, 0.2, 0.2, 0.2]]
    for i, metric in enumerate(metrics):
        ref.step(metric)
        lr = ours.step(metric, lr)
        assert lr == pytest.approx(opt.param_groups[0]["lr"]), (i, metric)
        seen.append(lr)
    assert any(b > a for a, b in zip(seen, seen[1:])) and any(b < a for a, b in zip(seen, seen[1:]))


def test_weight_decay_mask_follows_hf_rule():
    paths = [
        "model.layers.0.q_proj.kernel",
        "model.layers.0.q_proj.bias",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.final_norm.weight",
        "encoder.ln.weight",
        "encoder.ln_scale.weight",
        "encoder.Normalizer.kernel",
    ]
    mask = decay_mask(dict.fromkeys(paths), layer_norm_paths={"encoder.ln"})
    assert mask == {
        paths[0]: True,
        paths[1]: False,
        paths[2]: False,
        paths[3]: False,
        paths[4]: False,
        paths[5]: False,
        paths[6]: True,
        paths[7]: True,
    }


_FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        "AutoModelForCausalLM",
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        ),
        "AutoModelForCausalLM",
    ),
    "gpt2": ("GPT2Config", dict(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16), "AutoModelForCausalLM"),
    "bert": (
        "BertConfig",
        dict(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        ),
        "AutoModelForSequenceClassification",
    ),
    "t5": (
        "T5Config",
        dict(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, decoder_start_token_id=0),
        "AutoModelForSeq2SeqLM",
    ),
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_decay_groups_equal_hf_on_every_family(family):
    """jtrainer's decay groups on its models are HF's `get_decay_parameter_names` on the torch twins."""
    pytest.importorskip("torch")
    import transformers
    from flax import nnx

    from jtrainer import Trainer, models
    from jtrainer.models import hf_io

    config_name, kwargs, auto_name = _FAMILIES[family]
    config = getattr(transformers, config_name)(**kwargs)
    torch_model = getattr(transformers, auto_name).from_config(config)
    hf_decayed = set(transformers.Trainer.get_decay_parameter_names(None, torch_model))
    # A torch model (the bridge): transformers' own list, in its order.
    ours_torch = Trainer.get_decay_parameter_names(Trainer.__new__(Trainer), torch_model)
    assert ours_torch == transformers.Trainer.get_decay_parameter_names(None, torch_model)
    model = getattr(models, auto_name).from_config(config)
    ours = Trainer.get_decay_parameter_names(Trainer.__new__(Trainer), model)
    ours_hf = {hf_io.hf_names(model, tuple(p.split(".")))[0][0] for p in ours}
    every = {hf_io.hf_names(model, path)[0][0] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert ours_hf == hf_decayed & every
    assert any(not n.endswith("bias") for n in every - ours_hf)  # the test sees excluded norm weights


def test_optim_args_parsing():
    """HF's parsing: strings per key (each optimizer converts what it reads)."""
    assert parse_optim_args("momentum=0.9, nesterov=True,dampening=0") == {
        "momentum": "0.9",
        "nesterov": "True",
        "dampening": "0",
    }


@pytest.mark.parametrize("name", SUPPORTED_OPTIMIZERS)
def test_every_optimizer_builds_and_descends(name):
    options = None if name.startswith("rmsprop_bnb") else "momentum=0.9"  # HF's bnb RMSprop takes none
    args = TrainingArguments("o", optim=name, learning_rate=0.05, optim_args=options, report_to="none")
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
    multiplier = schedule_multiplier("constant", 0.05)
    tx = make_optimizer(args, {"w": True, "b": False}, multiplier=multiplier, warmup_steps=0, total_steps=10)
    state = tx.init(params)
    loss = lambda p: jnp.sum((p["w"] @ jnp.ones(4) + p["b"]) ** 2)  # noqa: E731
    start = loss(params)

    @jax.jit  # the schedule's numbers are traced from the state
    def update(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(5):
        params, state = update(params, state)
    assert loss(params) < start
    assert float(find_hyperparams(state)["learning_rate"]) == pytest.approx(0.05)


@pytest.mark.parametrize("name,kwargs", SCHEDULES)
def test_schedule_numbers_are_data(name, kwargs):
    """The rate each update used is HF's schedule at that step, computed under jit from the state's numbers."""
    args = TrainingArguments("o", learning_rate=0.05, report_to="none")
    tx = make_optimizer(args, None, multiplier=schedule_multiplier(name, 0.05, kwargs), warmup_steps=3, total_steps=12)
    params = {"w": jnp.ones(3)}
    update = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    state = tx.init(params)
    expected = make_schedule(name, 0.05, 3, 12, dict(kwargs))
    for step in range(12):
        state = update(params, state)
        assert float(find_hyperparams(state)["learning_rate"]) == pytest.approx(float(expected(step)), rel=1e-5)


def test_unknown_optimizer_lists_supported():
    from transformers.training_args import OptimizerNames

    args = TrainingArguments("o", optim="galore_adamw", report_to="none")
    assert OptimizerNames("galore_adamw")
    with pytest.raises(ValueError, match="adamw_torch"):
        make_optimizer(args, None)
