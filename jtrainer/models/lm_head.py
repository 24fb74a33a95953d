"""A causal LM's head and loss: whole logits, or the loss alone computed in chunks of positions.

The Trainer asks for the loss alone (`skip_logits=True`) wherever nothing reads the logits — its own training
loss and loss-only evaluation — and the chunked loss then never holds the [tokens, vocabulary] logits: the
default, sized by `loss_chunk_size`. `use_liger_kernel` keeps HF's meaning on top: the model itself skips logits
in every training call (Liger's patched forward), whatever reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jtrainer.numerics.losses import chunked_token_loss, token_loss


class ChunkedLossHead:
    """What a causal-LM family mixes in to take part: `loss_chunk_positions` (positions per chunk; None: the
    loss from whole logits even without them) and `skip_logits_in_training` (use_liger_kernel), both set by the
    Trainer. `chunks_causal_lm_loss` tells the Trainer the model takes `skip_logits`."""

    chunks_causal_lm_loss = True
    loss_chunk_positions: int | None = None
    skip_logits_in_training = False
    deterministic = False

    def resolve_skip_logits(self, skip_logits: bool | None, labels) -> bool:
        """`skip_logits` as given, or unset: Liger's rule (training with labels) when use_liger_kernel is on."""
        if skip_logits is None:
            return self.skip_logits_in_training and not self.deterministic and labels is not None
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True computes the loss without logits: it needs labels.")
        return bool(skip_logits)

    def head_outputs(
        self,
        hidden_BxLxD: jax.Array,
        project: Callable[[jax.Array], jax.Array],
        labels,
        num_items_in_batch,
        skip_logits: bool,
    ) -> tuple[jax.Array | None, jax.Array | None]:
        """(loss, logits): HF's causal-LM loss (labels shifted, -100 ignored, sum / num_items_in_batch or the
        mean); with `skip_logits`, the loss alone, in chunks of `loss_chunk_positions` positions."""
        if skip_logits:
            if self.loss_chunk_positions is None:
                return token_loss(project(hidden_BxLxD), labels, num_items_in_batch, causal=True), None
            loss = chunked_token_loss(
                hidden_BxLxD,
                project,
                labels,
                num_items_in_batch,
                chunk_positions=self.loss_chunk_positions,
                causal=True,
            )
            return loss, None
        logits = project(hidden_BxLxD)
        if labels is None:
            return None, logits
        return token_loss(logits, labels, num_items_in_batch, causal=True), logits
