"""Where a transformers model's weights go on the mesh: logical axes from its own tensor-parallel plan
(`model.tp_plan`: colwise / rowwise linear layers, row-split embeddings) and expert-parallel plan (`model.ep_plan`:
the stacked weights of a mixture of experts, experts first), which the rules table of
`jtrainer.parallel.sharding` maps to mesh axes like a native model's ('mlp'/'vocab' -> tensor, 'embed' -> fsdp,
'expert' -> expert). Weights the plans do not name are fsdp-split on their largest dimension
(`sharding.default_spec`). Pure: no torch."""

from __future__ import annotations

import fnmatch
import re

# The logical axes of a torch Linear's weight [out, in] and bias [out], or an Embedding's weight [rows, dim],
# under each of transformers' tensor-parallel styles.
_STYLES: dict[str, dict[str, tuple[str | None, ...]]] = {
    "colwise": {"weight": ("mlp", "embed"), "bias": ("mlp",)},
    "rowwise": {"weight": ("embed", "mlp"), "bias": ("norm",)},
    "colwise_gather_output": {"weight": ("vocab", "embed"), "bias": ("vocab",)},
    "embedding_rowwise": {"weight": ("vocab", "embed")},
}
_STYLES["local_colwise"] = _STYLES["colwise"]
_STYLES["local_rowwise"] = _STYLES["rowwise"]
_STYLES["rowwise_split_input"] = _STYLES["rowwise"]  # the same weights; only the input's layout differs
# Styles whose weights are laid out elsewhere (ep_plan's stacked experts) or not over 'tensor' by torch either.
_NOT_SPLIT = frozenset({"grouped_gemm", "replicated_with_grad_allreduce"})


def unknown_style(name: str, plan: dict[str, str]) -> str | None:
    """The plan's style for weight `name` when it is one this module does not lay out (None otherwise)."""
    name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    style = plan_style(name, plan) or plan_style(name.rpartition(".")[0], plan)
    return style if style is not None and style not in _STYLES and style not in _NOT_SPLIT else None


def plan_style(module_name: str, plan: dict[str, str]) -> str | None:
    """The plan's style for a module name (`model.layers.3.mlp.up_proj`); '*' matches one name part."""
    parts = module_name.split(".")
    for pattern, style in plan.items():
        pattern_parts = pattern.split(".")
        if len(pattern_parts) == len(parts) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)):
            return style
    return None


# peft's names: a PeftModel's weights sit under `base_model.model.`; a LoRA-wrapped Linear keeps its own weight as
# `<module>.base_layer.weight` and adds `<module>.lora_A.<adapter>.weight` [r, in], `.lora_B.<adapter>.weight` [out, r].
_PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.[^.]+\.weight$")


def _expert_axes(name: str, shape: tuple[int, ...], hidden_size: int | None) -> tuple[str | None, ...] | None:
    """A mixture of experts' stacked weight [experts, a, b]: experts over 'expert', the model's hidden dimension
    over 'embed' and the experts' own over 'mlp' (torch's [out, in] order where both have the hidden size)."""
    if len(shape) != 3:
        return None
    rest = ["embed" if size == hidden_size else "mlp" for size in shape[1:]]
    if rest[0] == rest[1]:  # not told apart by size: down_proj is [hidden, mlp], the others [mlp, hidden]
        rest = ["embed", "mlp"] if "down" in name.rpartition(".")[2] else ["mlp", "embed"]
    return ("expert", *rest)


def logical_axes(
    name: str, shape: tuple[int, ...], plan: dict[str, str], hidden_size: int | None = None
) -> tuple[str | None, ...] | None:
    """A weight's logical axes by its HF name, or None (fsdp on its largest dimension) where the plans are silent.
    Under peft, a wrapped layer's base weight is laid out as the layer's, and LoRA's factors share its input
    (A) or output (B) axis, so adapters follow the same rules as the weights they adapt."""
    ndim = len(shape)
    name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    lora = _LORA.match(name)
    if lora is not None:
        out_axis, in_axis = logical_axes(f"{lora['module']}.weight", (0, 0), plan) or (None, None)
        axes = (None, in_axis) if lora["side"] == "A" else (out_axis, None)
        return axes if ndim == 2 and axes != (None, None) else None
    if plan_style(name, plan) == "grouped_gemm":  # ep_plan names the stacked parameter itself
        return _expert_axes(name, shape, hidden_size)
    module_name, _, leaf = name.rpartition(".")
    style = plan_style(module_name, plan)
    styled = _STYLES.get(style or "", {}).get(leaf)
    return styled if styled is not None and len(styled) == ndim else None
