"""The demo's synthetic corpus: variable-length token sequences, padded and masked.

Each sequence belongs to one of a few *topics*. A topic is a first-order Markov
chain over the content tokens (each token has a handful of likely successors, so
the loss can fall well below ``log(vocab)``), and a length range: some topics
are short (chat turns), others long (documents). A sequence starts with its
topic's marker token, so a causal model can learn which chain it is reading.

Batches are laid out the way packing and length bucketing lay them out: with
``skew=1`` each batch is sorted by length, so the first microbatch holds the
short sequences and the last the long ones; with ``skew=0`` the order is random.
Everything is drawn from a ``numpy`` generator seeded by the caller.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "Batches",
    "Corpus",
    "arrange",
    "make_batches",
    "make_corpus",
    "sample_sequences",
    "to_batches",
]

PAD = 0


class Corpus(NamedTuple):
    """The generating process of the synthetic corpus.

    Attributes:
      vocab_size: number of token ids, including ``PAD = 0`` and the markers.
      seq_len: model input length; sequences hold at most ``seq_len + 1`` tokens.
      markers: ``(num_topics,)`` the first token of each topic's sequences.
      transitions: ``(num_topics, num_content, num_content)`` row-stochastic.
      length_ranges: ``(num_topics, 2)`` inclusive ``[low, high]`` of the number
        of tokens per sequence (marker included).
    """

    vocab_size: int
    seq_len: int
    markers: np.ndarray
    transitions: np.ndarray
    length_ranges: np.ndarray

    @property
    def first_content(self) -> int:
        return int(self.markers.max()) + 1


class Batches(NamedTuple):
    """Padded sequences and their loss masks.

    Attributes:
      inputs: ``(..., seq_len)`` int32 model inputs (``PAD`` after the end).
      targets: ``(..., seq_len)`` int32 next tokens.
      mask: ``(..., seq_len)`` bool, True where ``targets`` is a real token.
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


def make_corpus(
    rng: np.random.Generator,
    *,
    vocab_size: int = 64,
    seq_len: int = 64,
    num_topics: int = 4,
    successors: int = 3,
) -> Corpus:
    """Draws the topics' Markov chains and assigns them length ranges.

    Half the topics are short (3 to 10 tokens), half long (a third of
    ``seq_len`` up to ``seq_len + 1``).
    """
    markers = np.arange(1, num_topics + 1)
    num_content = vocab_size - num_topics - 1
    transitions = np.zeros((num_topics, num_content, num_content))
    for t in range(num_topics):
        for a in range(num_content):
            nxt = rng.choice(num_content, size=successors, replace=False)
            transitions[t, a, nxt] = rng.dirichlet(np.ones(successors))
    # A little mass everywhere: every token stays possible after every token.
    transitions = 0.97 * transitions + 0.03 / num_content
    short = np.array([3, 10])
    long = np.array([seq_len // 3, seq_len + 1])
    length_ranges = np.stack([short if t % 2 == 0 else long for t in range(num_topics)])
    return Corpus(vocab_size, seq_len, markers, transitions, length_ranges)


def sample_sequences(
    rng: np.random.Generator, corpus: Corpus, num: int
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` padded sequences ``(num, seq_len + 1)`` and their lengths ``(num,)``."""
    num_topics, num_content, _ = corpus.transitions.shape
    topics = rng.integers(num_topics, size=num)
    low, high = corpus.length_ranges[topics].T
    lengths = rng.integers(low, high + 1)
    tokens = np.full((num, corpus.seq_len + 1), PAD, dtype=np.int32)
    tokens[:, 0] = corpus.markers[topics]
    state = rng.integers(num_content, size=num)
    cumulative = np.cumsum(corpus.transitions, axis=-1)
    for pos in range(1, corpus.seq_len + 1):
        live = pos < lengths
        tokens[live, pos] = corpus.first_content + state[live]
        u = rng.random(num)[:, None]
        rows = cumulative[topics, state]
        state = np.minimum((u > rows).sum(axis=-1), num_content - 1)
    return tokens, lengths


def arrange(rng: np.random.Generator, lengths: np.ndarray, skew: float) -> np.ndarray:
    """A permutation of one batch: sorted by length at ``skew=1``, random at 0.

    Sorts by ``skew · rank(length) + (1 − skew) · uniform``, both scaled to
    ``[0, 1]``, so intermediate values interpolate between the two layouts.

    Examples:
      >>> import numpy as np
      >>> lengths = np.array([30, 2, 17, 5])
      >>> print(lengths[arrange(np.random.default_rng(0), lengths, skew=1.0)])
      [ 2  5 17 30]
    """
    n = len(lengths)
    rank = np.argsort(np.argsort(lengths, kind="stable"), kind="stable") / max(n - 1, 1)
    key = skew * rank + (1.0 - skew) * rng.random(n)
    return np.argsort(key, kind="stable")


def make_batches(
    rng: np.random.Generator,
    corpus: Corpus,
    *,
    num_batches: int,
    batch_size: int,
    skew: float,
) -> Batches:
    """``num_batches`` batches of ``batch_size`` sequences, each laid out by ``skew``.

    Returns arrays of shape ``(num_batches, batch_size, seq_len)``; splitting a
    batch into ``k`` consecutive microbatches then gives the length skew. Batches
    are drawn one after the other, so the first ones do not depend on
    ``num_batches``.
    """
    batches = []
    for _ in range(num_batches):
        tokens, lengths = sample_sequences(rng, corpus, batch_size)
        batches.append(tokens[arrange(rng, lengths, skew)])
    return to_batches(np.stack(batches))


def to_batches(tokens: np.ndarray) -> Batches:
    """Shifts padded sequences into inputs, next-token targets and a loss mask."""
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    return Batches(inputs, targets, targets != PAD)
