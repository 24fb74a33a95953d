"""What every jtrainer model shares: an HF config held statically, and HF-format from_config / save / load."""

from __future__ import annotations

from flax import nnx


class StaticConfig:
    """Holds an HF config as a static, hashable attribute of an nnx module (identity hash: configs are unhashable)."""

    def __init__(self, config):
        self.config = config

    def __hash__(self):
        return id(self.config)

    def __eq__(self, other):
        return isinstance(other, StaticConfig) and other.config is self.config


class PretrainedMixin:
    """`config`, `from_config`, `save_pretrained` and `from_pretrained` in HF's format (see hf_io)."""

    config_class: type
    main_input_name = "input_ids"

    @property
    def config(self):
        return self._config.config

    @classmethod
    def from_config(cls, config, *, seed: int = 0, **kwargs):
        return cls(config, rngs=nnx.Rngs(seed), **kwargs)

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        from jtrainer.models import hf_io

        hf_io.save_pretrained(self, save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, directory: str, *, dtype=None, mesh=None, logical_axis_rules=None, **kwargs):
        """A local folder of config.json + safetensors (as PyTorch transformers writes it).

        The model is built abstractly (no random weights are allocated), then every parameter is read from
        disk; with `mesh`, straight onto its sharding, slice by slice. `dtype` (e.g. jnp.bfloat16) casts them.
        """
        from jtrainer import sharding
        from jtrainer.models import hf_io

        config = cls.config_class.from_pretrained(directory)
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), **kwargs))
        rules = sharding.merged_rules(logical_axis_rules) if mesh is not None else None
        hf_io.load_weights(model, directory, mesh=mesh, rules=rules, dtype=dtype)
        return model
