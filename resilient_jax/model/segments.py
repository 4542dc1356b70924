"""The documents inside a training row, for block-causal attention (`data.document_mask`).

A training row is a window of one token stream in which every document is followed by the
tokenizer's end-of-text token. `documents` splits the model's input row at those tokens: token i
belongs to the document that the end-of-text tokens before it say (`segment_ids_BL[b, i]` = how
many end-of-text tokens come strictly before position i), so an end-of-text token belongs to the
document it ends and the next document starts right after it. Positions restart at 0 at each
document's first token; a row that begins inside a document simply starts that document at
position 0. The model then lets a token attend only to earlier tokens of its own document and
rotates its query and key by its position in that document (`resilient_jax.model.Attention`), so
a document computes the same logits wherever in a row it lies.

Once attention stays inside a document, restarting its positions changes nothing in exact
arithmetic (rotary scores depend only on position differences); it keeps the float32 rotation
angles those of the document alone, whose logits would otherwise drift with its offset in the row
(small_cpu's model with random weights, logits up to 37: a 64-token document after 4,000 tokens
is 1e-3 off with positions counted from the row's start, 1.5e-5 with restarted ones).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Documents:
    """Per token of a [B, L] row: its document's index in the row and its position in it."""

    segment_ids_BL: jax.Array  # int32, 0 for the row's first document, +1 after each end-of-text
    positions_BL: jax.Array  # int32, 0 at each document's first token

    def same_document(self) -> jax.Array:
        """[B, 1, L, L] bool: query i and key j are in one document (the heads' axis broadcasts,
        as `jax.nn.dot_product_attention`'s mask takes it)."""
        ids = self.segment_ids_BL
        return (ids[:, :, None] == ids[:, None, :])[:, None]


def documents(tokens_BL: jax.Array, eos_id: int) -> Documents:
    """The documents of the rows `tokens_BL` (the model's input), split after each `eos_id`."""
    is_eos_BL = (tokens_BL == eos_id).astype(jnp.int32)
    # Exclusive count: the end-of-text token itself still belongs to the document it ends.
    segment_ids_BL = jnp.cumsum(is_eos_BL, axis=1, dtype=jnp.int32) - is_eos_BL
    index_L = jnp.arange(tokens_BL.shape[1], dtype=jnp.int32)
    # A document starts at the row's first token and right after each end-of-text token; a
    # running maximum of the start indices gives each token its own document's start.
    starts_BL = jnp.pad(is_eos_BL[:, :-1], ((0, 0), (1, 0)), constant_values=1).astype(bool)
    first_BL = jax.lax.cummax(jnp.where(starts_BL, index_L[None, :], 0), axis=1)
    return Documents(segment_ids_BL, index_L[None, :] - first_BL)
