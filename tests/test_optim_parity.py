"""Every `optim` name against the torch optimizer `transformers.Trainer.create_optimizer()` builds for it.

The torch side is HF's own Trainer (its optimizer and scheduler, float64 parameters); jtrainer's side is the optax
transformation the Trainer steps with. Both see the same gradients for 10 steps with weight decay on, under a
constant rate and under linear warmup + decay; parameters must agree to 1e-6 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jtrainer import TrainingArguments  # noqa: E402
from jtrainer.numerics.opt_state import current_learning_rate  # noqa: E402
from jtrainer.numerics.optim import SUPPORTED_OPTIMIZERS, make_optimizer, schedule_free_eval_params  # noqa: E402
from jtrainer.numerics.schedules import schedule_multiplier  # noqa: E402

STEPS = 10

# (optim, optim_args, reference package the HF optimizer needs)
CASES = [
    ("adamw_torch", None, None),
    ("adamw_torch_fused", None, None),
    ("adafactor", None, None),
    ("sgd", None, None),
    ("sgd", "momentum=0.9", None),
    ("sgd", "momentum=0.9,dampening=0.1", None),
    ("sgd", "momentum=0.8,nesterov=True", None),
    ("adagrad", None, None),
    ("adagrad", "lr_decay=0.05,eps=1e-3", None),
    ("rmsprop", None, None),
    ("rmsprop", "momentum=0.9", None),
    ("rmsprop", "centered=True,alpha=0.9,eps=1e-6,momentum=0.5", None),
    ("rmsprop_bnb", None, "bitsandbytes"),
    ("rmsprop_bnb_32bit", None, "bitsandbytes"),
    ("rmsprop_bnb_8bit", None, "bitsandbytes"),
    ("schedule_free_adamw", None, "schedulefree"),
    ("schedule_free_adamw", "weight_lr_power=1.5,r=0.5", "schedulefree"),
    ("schedule_free_sgd", None, "schedulefree"),
    ("stable_adamw", None, "optimi"),
    ("stable_adamw", "decouple_lr=True,max_lr=0.05", "optimi"),
    ("lion_32bit", None, "bitsandbytes"),
    ("paged_lion_32bit", None, "bitsandbytes"),
    ("ademamix", None, "bitsandbytes"),
    ("ademamix", "beta3=0.999,alpha=3.0,t_alpha=6,t_beta3=8", "bitsandbytes"),
    ("paged_ademamix_32bit", "t_alpha=4", "bitsandbytes"),
    ("adamw_bnb_8bit", None, "bitsandbytes"),
    ("adamw_8bit", None, "bitsandbytes"),
    ("paged_adamw_32bit", None, "bitsandbytes"),
    ("paged_adamw_8bit", None, "bitsandbytes"),
    ("lion_8bit", None, "bitsandbytes"),
    ("paged_lion_8bit", None, "bitsandbytes"),
    ("ademamix_8bit", None, "bitsandbytes"),
    ("paged_ademamix_8bit", None, "bitsandbytes"),
]
# Names whose HF optimizer keeps 8/4-bit state: compared with the 32-bit rule of the same class (HF's 32-bit name).
THIRTY_TWO_BIT = {
    "adamw_bnb_8bit": "paged_adamw_32bit",
    "adamw_8bit": "paged_adamw_32bit",
    "paged_adamw_8bit": "paged_adamw_32bit",
    "lion_8bit": "lion_32bit",
    "paged_lion_8bit": "lion_32bit",
    "ademamix_8bit": "ademamix",
    "paged_ademamix_8bit": "ademamix",
    "rmsprop_bnb_8bit": "rmsprop_bnb_32bit",
    "adamw_torch_4bit": "adamw_torch",
    "adamw_torch_8bit": "adamw_torch",
}
# Their packages (torch_xla, torch_npu, torchao, torchdistx) do not install on this CPU: these AdamW variants are
# compared with torch's AdamW.
NOT_IN_CASES = {
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "adamw_anyprecision",
}


class Toy(torch.nn.Module):
    """Every kind of parameter the decay groups and factoring see: Linear weight/bias, LayerNorm (excluded by type),
    a norm-named Linear (excluded by name), a 3-D stack (factored over its last two dims) and a plain vector."""

    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(6, 5)
        self.ln = torch.nn.LayerNorm(5)
        self.out_norm = torch.nn.Linear(5, 3)
        self.stack = torch.nn.Parameter(torch.zeros(2, 3, 4))
        self.scale = torch.nn.Parameter(torch.zeros(7))


def _initial_values():
    rng = np.random.RandomState(0)
    return {
        name: rng.normal(0, 0.5, shape)
        for name, shape in [
            ("dense.weight", (5, 6)),
            ("dense.bias", (5,)),
            ("ln.weight", (5,)),
            ("ln.bias", (5,)),
            ("out_norm.weight", (3, 5)),
            ("out_norm.bias", (3,)),
            ("stack", (2, 3, 4)),
            ("scale", (7,)),
        ]
    }


def _gradients(values):
    rng = np.random.RandomState(1)
    return [{k: rng.normal(0, 1.0, v.shape) for k, v in values.items()} for _ in range(STEPS)]


def _hf_args(tmp_path, optim, optim_args, scheduler, cls):
    warmup = 3 if scheduler == "linear" else 0
    return cls(
        str(tmp_path),
        optim=optim,
        optim_args=optim_args,
        learning_rate=0.05,
        weight_decay=0.1,
        lr_scheduler_type=scheduler,
        warmup_steps=warmup,
        report_to="none",
        adam_beta2=0.99,
    )


def _torch_run(tmp_path, optim, optim_args, scheduler, values, grads):
    """HF's Trainer builds the optimizer and scheduler; the loop steps them as its training loop does."""
    model = Toy().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.tensor(values[name]))
    args = _hf_args(tmp_path, optim, optim_args, scheduler, transformers.TrainingArguments)
    trainer = transformers.Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    decayed = set(trainer.get_decay_parameter_names(model))
    rates = []
    for g in grads:
        if hasattr(opt, "train"):
            opt.train()
        for name, p in model.named_parameters():
            p.grad = torch.tensor(g[name])
        opt.step()
        rates.append(sched.get_last_lr()[0])
        sched.step()
    after_train = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    evaluated = None
    if hasattr(opt, "eval"):  # HF's evaluation_loop calls optimizer.eval(): the model then holds x
        opt.eval()
        evaluated = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return after_train, evaluated, decayed, rates


def _jax_run(tmp_path, optim, optim_args, scheduler, values, grads, decayed):
    args = _hf_args(tmp_path, optim, optim_args, scheduler, TrainingArguments)
    warmup = args.get_warmup_steps(STEPS)
    mask = {k: k in decayed for k in values}
    tx = make_optimizer(
        args,
        mask,
        multiplier=schedule_multiplier(scheduler, args.learning_rate),
        warmup_steps=warmup,
        total_steps=STEPS,
    )
    params = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    rates = []
    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v, jnp.float32) for k, v in g.items()})
        rates.append(float(current_learning_rate(state)))
    evaluated = schedule_free_eval_params(state, params)
    as_np = lambda tree: None if tree is None else {k: np.asarray(v, np.float64) for k, v in tree.items()}  # noqa: E731
    return as_np(params), as_np(evaluated), rates


def _assert_close(ours, ref, what):
    for name in ref:
        scale = max(np.max(np.abs(ref[name])), 1e-3)
        err = np.max(np.abs(ours[name] - ref[name])) / scale
        assert err < 1e-6, f"{what}: {name} differs by {err:.2e} (relative to its largest entry)"


@pytest.mark.parametrize("scheduler", ["constant", "linear"])
@pytest.mark.parametrize("optim, optim_args, package", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_optimizer_equals_hf(tmp_path, optim, optim_args, package, scheduler):
    if package:
        pytest.importorskip(package)
    values = _initial_values()
    grads = _gradients(values)
    reference = THIRTY_TWO_BIT.get(optim, optim)
    ref_params, ref_eval, decayed, ref_rates = _torch_run(tmp_path, reference, optim_args, scheduler, values, grads)
    assert decayed == {"dense.weight", "stack", "scale"}  # HF's groups: LayerNorm by type, biases and norms by name
    params, evaluated, rates = _jax_run(tmp_path, optim, optim_args, scheduler, values, grads, decayed)
    _assert_close(params, ref_params, f"{optim} parameters after {STEPS} steps")
    np.testing.assert_allclose(rates, ref_rates, rtol=1e-6)
    assert (evaluated is None) == (ref_eval is None)
    if ref_eval is not None:
        _assert_close(evaluated, ref_eval, f"{optim} evaluation (x) parameters")


def test_every_supported_name_is_compared():
    assert set(SUPPORTED_OPTIMIZERS) == {c[0] for c in CASES} | NOT_IN_CASES


@pytest.mark.parametrize("optim", sorted(NOT_IN_CASES))
def test_names_without_their_package_run_adamw(tmp_path, optim):
    values = _initial_values()
    grads = _gradients(values)
    ref, _, decayed, _ = _torch_run(tmp_path, "adamw_torch", None, "linear", values, grads)
    params, _, _ = _jax_run(tmp_path, optim, None, "linear", values, grads, decayed)
    _assert_close(params, ref, optim)


@pytest.mark.parametrize(
    "optim, optim_args, match",
    [
        ("sgd", "momentum=0,nesterov=True", "nesterov"),
        ("sgd", "momentum", "key=value"),
        ("rmsprop_bnb", "alpha=0.9", "as strings"),
        ("stable_adamw", "decouple_lr=True", "max_lr"),
        ("adamw_anyprecision", "use_kahan_summation=True", "not reproduced"),
    ],
)
def test_options_hf_cannot_match_are_refused_at_construction(optim, optim_args, match):
    from conftest import tiny_llama_config

    from jtrainer import Trainer
    from jtrainer.models import LlamaForCausalLM

    args = TrainingArguments("o", optim=optim, optim_args=optim_args, report_to="none")
    with pytest.raises(ValueError, match=match):
        Trainer(model=LlamaForCausalLM.from_config(tiny_llama_config()), args=args)


def test_options_without_effect_warn(caplog):
    from jtrainer.numerics.optim import optimizer_context

    with caplog.at_level("WARNING"):
        optimizer_context(TrainingArguments("o", optim="sgd", optim_args="momentum=0.9,foo=1", report_to="none"))
    assert "foo=1 has no effect" in caplog.text
