"""The torch semantics zoo: small torch modules, each exercising one behaviour of user torch code the bridge must
keep (views and in-place ops, buffers, custom autograd, frozen and shared parameters, modes, output types), and
the side-by-side run of one against transformers.Trainer (torch eager). Imported by tests/test_bridge_semantics.py
and tests/jobs/bridge_zoo_job.py (8 devices)."""

import copy
import tempfile

import numpy as np
import torch
import transformers
from conftest import torch_rows
from transformers.modeling_outputs import SequenceClassifierOutput

WIDTH = 8


def rows(n=24, seed=0):
    rng = np.random.RandomState(seed)
    return [{"x": rng.randn(WIDTH).astype(np.float32), "labels": np.float32(rng.randn())} for _ in range(n)]


class Regression(torch.nn.Module):
    """A plain module returning a dict with the loss; subclasses change `body` (or the whole forward)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)

    def body(self, h):
        return h

    def predict(self, x):
        return self.head(torch.tanh(self.body(self.inner(x)))).squeeze(-1)

    def forward(self, x, labels=None):
        y = self.predict(x)
        return {"loss": torch.nn.functional.mse_loss(y, labels) if labels is not None else None, "logits": y}


class Narrow(Regression):
    def body(self, h):
        h = h * 1.0
        h.narrow(1, 0, 4).add_(1.0)  # through the view into h
        return h


class SelectTranspose(Regression):
    def body(self, h):
        h = h * 1.0
        h.t()[0].mul_(3.0)  # a select of a transpose: column 0 of h
        h[:, 1:3] += 0.5  # basic indexing
        return h


class ViewThenBase(Regression):
    def body(self, h):
        h = h * 1.0
        flat = h.view(-1)  # a view taken before the base changes
        h.add_(2.0)
        return flat.reshape(h.shape) * h


class UnsqueezeDiagonal(Regression):
    def body(self, h):
        h = h * 1.0
        square = h.unsqueeze(2).expand(-1, -1, WIDTH).clone()
        square.diagonal(dim1=1, dim2=2).mul_(-1.0)  # the diagonal of each row's square
        flat = square.view(h.shape[0], -1)
        flat.as_strided((h.shape[0], 2), (WIDTH * WIDTH, 1), 0).zero_()  # the first two of each row
        return square.sum(2)


class NonContiguousReshape(Regression):
    def body(self, h):
        h = h * 1.0
        copy = h.t().reshape(-1)  # not viewable: torch copies, the write stays there
        copy.add_(100.0)
        again = h.t().contiguous()  # a copy as well
        again.mul_(0.0)
        return h + copy.sum() * 0.0


class BatchNorm(Regression):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def body(self, h):
        return self.norm(h)


class InPlaceBuffer(Regression):
    """A buffer updated in forward (an exponential average of the inputs, training only), persistent, and a
    non-persistent one read in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("average", torch.zeros(WIDTH))
        self.register_buffer("scale", torch.full((WIDTH,), 0.5), persistent=False)

    def body(self, h):
        if self.training:
            with torch.no_grad():
                self.average.mul_(0.9).add_(0.1 * h.mean(0))
        return h * self.scale + self.average


class Cube(torch.autograd.Function):
    """x^3, with a backward that is deliberately not its derivative (torch uses it as written)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(x)
        ctx.factor = factor
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ctx.factor * x, None


class RoundStraightThrough(torch.autograd.Function):
    """The newer form: forward without ctx, setup_context apart."""

    @staticmethod
    def forward(x):
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomAutograd(Regression):
    def body(self, h):
        return RoundStraightThrough.apply(Cube.apply(h, 2.0))


class Frozen(Regression):
    def __init__(self):
        super().__init__()
        self.inner.weight.requires_grad_(False)


class TiedAndReused(Regression):
    """One parameter under two names (a tied layer), and a layer used twice in a forward."""

    def __init__(self):
        super().__init__()
        self.twin = torch.nn.Linear(WIDTH, WIDTH)
        self.twin.weight = self.inner.weight

    def body(self, h):
        return self.inner(torch.tanh(self.twin(h)))


class NoGrad(Regression):
    def body(self, h):
        with torch.no_grad():
            gate = torch.sigmoid(h)  # no gradient through the gate, as in torch
        return h * gate


class ModeDependent(Regression):
    def body(self, h):
        return h * 2.0 if self.training else h - 1.0


class Constants(Regression):
    def body(self, h):
        shift = torch.tensor([0.5] * WIDTH)  # no device=: a constant of the step
        return h + shift + torch.from_numpy(np.arange(WIDTH, dtype=np.float32))


class TupleOutput(Regression):
    def forward(self, x, labels=None):
        y = self.predict(x)
        return (torch.nn.functional.mse_loss(y, labels), y) if labels is not None else (y,)


class ModelOutputReturn(Regression):
    def forward(self, x, labels=None):
        y = self.predict(x)
        loss = torch.nn.functional.mse_loss(y, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=y)


class KeywordsAndNoConfig(Regression):
    """transformers' own tests' regression module: `config = None` and a forward taking **kwargs (HF then passes
    num_items_in_batch, which it ignores)."""

    def __init__(self):
        super().__init__()
        self.config = None

    def forward(self, x, labels=None, **kwargs):
        return super().forward(x, labels)


ZOO = [
    Regression, Narrow, SelectTranspose, ViewThenBase, UnsqueezeDiagonal, NonContiguousReshape,
    BatchNorm, InPlaceBuffer, CustomAutograd, Frozen, TiedAndReused, NoGrad, ModeDependent, Constants, TupleOutput,
    ModelOutputReturn, KeywordsAndNoConfig,
]  # fmt: skip


def arguments(cls, out, per_device=4, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=8,
        learning_rate=0.05,
        optim="sgd",
        max_steps=3,
        logging_steps=1,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    kw.update(over)
    return cls(**kw)


def side_by_side(model_class, jtrainer_batch=4, torch_batch=4):
    """The same module trained 3 steps by transformers.Trainer (torch) and jtrainer, then evaluated: (losses,
    state_dicts, eval losses, predictions), each a (torch, jtrainer) pair."""
    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model, data = model_class(), rows()
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=arguments(transformers.TrainingArguments, tempfile.mkdtemp(), torch_batch),
        train_dataset=torch_rows(data),
    )
    ours = Trainer(
        model=copy.deepcopy(model),
        args=arguments(TrainingArguments, tempfile.mkdtemp(), jtrainer_batch),
        train_dataset=data,
    )
    hf.train()
    ours.train()
    held_out = rows(8, seed=1)
    return {
        "losses": tuple([h["loss"] for h in t.state.log_history if "loss" in h] for t in (hf, ours)),
        "state": (hf.model.state_dict(), ours.model.state_dict()),
        "eval_loss": (hf.evaluate(torch_rows(held_out))["eval_loss"], ours.evaluate(held_out)["eval_loss"]),
        "predictions": (hf.predict(torch_rows(held_out)).predictions, ours.predict(held_out).predictions),
    }


def differences(result) -> dict[str, float]:
    """The largest difference of each compared quantity (relative for losses)."""
    (hf_losses, jt_losses), (hf_state, jt_state) = result["losses"], result["state"]
    out = {"losses": float(np.max(np.abs(np.subtract(hf_losses, jt_losses)) / np.abs(hf_losses)))}
    assert set(hf_state) == set(jt_state)
    for name, value in hf_state.items():
        out[name] = float((value.double() - jt_state[name].double()).abs().max())
    out["eval_loss"] = abs(result["eval_loss"][0] - result["eval_loss"][1])
    out["predictions"] = float(np.max(np.abs(result["predictions"][0] - result["predictions"][1])))
    return out
