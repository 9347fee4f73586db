"""The demo's model: a tiny pre-norm transformer causal language model (Flax linen)."""

from __future__ import annotations

from typing import cast

import flax.linen as nn
import jax
import optax

import masked_multistep as mm

__all__ = ["CausalLM", "token_mean_loss"]


class Block(nn.Module):
    """Causal self-attention and an MLP, each with a residual connection."""

    d_model: int
    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, causal_mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, qkv_features=self.d_model
        )(h, mask=causal_mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d_model)(h)
        h = nn.Dense(self.d_model)(nn.gelu(h))
        return x + h


class CausalLM(nn.Module):
    """Token and position embeddings, ``num_layers`` blocks, tied output layer.

    Maps ``(batch, seq_len)`` int tokens to ``(batch, seq_len, vocab_size)``
    logits; position ``t`` sees tokens ``0..t`` only.
    """

    vocab_size: int = 64
    max_len: int = 64
    d_model: int = 48
    num_heads: int = 4
    num_layers: int = 1

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.d_model)
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        x = embed(tokens) + positions[None, : tokens.shape[-1]]
        causal_mask = nn.make_causal_mask(tokens)
        for _ in range(self.num_layers):
            x = Block(self.d_model, self.num_heads)(x, causal_mask)
        return embed.attend(nn.LayerNorm()(x))


def token_mean_loss(
    model: CausalLM,
    params,
    inputs: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy over the real tokens, and their count."""
    # `apply` without `mutable=` returns the output alone, not (output, state).
    logits = cast(jax.Array, model.apply({"params": params}, inputs))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return mm.masked_mean(losses, mask)
