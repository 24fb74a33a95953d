"""torchax's error for a torch op it has no JAX lowering for, read without importing torchax."""

from __future__ import annotations

import re


def unlowered_op(error: BaseException) -> str | None:
    """The torch op named by torchax's "no lowering" error (`aten::_grouped_mm`), or None for any other error."""
    if type(error).__name__ != "OperatorNotFound":
        return None
    match = re.search(r"name (\S+) has no lowering", str(error))
    return match.group(1) if match else str(error).splitlines()[0]
