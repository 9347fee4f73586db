"""Train a small transformer language model with token-weighted accumulation.

A complete Flax NNX training script on the package's synthetic corpus
(``masked_multistep.demo.data``: variable-length sequences from topic-dependent
Markov chains, padded and masked). Each optimizer update ("window") sees one
batch of ``--batch-size`` sequences, sorted by length and fed as ``k =
--microbatches`` microbatches of very different token counts;
``mm.MaskedMultiSteps`` weights each microbatch by its count, so every update
uses the gradient of the whole batch's token-mean loss. What it shows:

* the masked token-mean loss (``mm.masked_mean``) and its token count;
* gradient clipping in the right place: *inside* the wrapper,
  ``MaskedMultiSteps(optax.chain(clip_by_global_norm(c), adamw(schedule)), k)``,
  so the window's full-batch gradient is clipped (clipping each microbatch
  before the wrapper would not give the full-batch gradient);
* a warmup-cosine learning rate that advances once per window, read back from
  the optimizer state (``optax.inject_hyperparams``);
* one log line per window: its token-weighted loss, its tokens, the learning
  rate its update used, read from the optimizer state (``window_stats=True``
  and ``mm.window_stats``: no host round trip per microbatch, nothing to
  checkpoint beside the state); also appended to ``OUT/metrics.jsonl`` with
  the smoothed gradient noise scale, in tokens (length-sorted microbatches,
  ``--skew`` above 0 as by default, inflate it: read it from a run with
  ``--skew 0``), and the norm of the window's gradient, in
  all and by layer (``per_leaf_stats=True`` and ``mm.window_stats(...,
  groups=...)``: the embeddings, each block, the final norm), before
  clipping; a window without tokens applies no update and logs ``null`` for
  the loss and the rate;
* ``--devices N``: data parallel over ``N`` devices, each keeping its own
  running mean of its share of every microbatch, combined once per window
  (``mm.per_device_value_and_grad`` and ``reduction=mm.deferred(mesh)``): the
  same windows and losses as on one device, to float32 rounding (the logged
  noise scale then counts every device's share of a microbatch as a
  microbatch, ``K = N·k``: an estimate of the same figure from more, smaller
  microbatches, with its own noise, and with ``--skew`` above 0 its own bias);
* orbax checkpoints every ``--checkpoint-every`` windows, and ``--resume``.
  A checkpoint may also fall in the middle of a window (``--stop-after``, the
  way a preemption handler saves): the optimizer state holds the half-accumulated
  window, and the resumed run continues bit for bit as if never stopped.
  ``--resume`` may change ``--devices``: the pending window's running means
  move onto the new devices (``mm.device_count_target`` and
  ``mm.from_device_count``), and the run continues to float32 rounding.

Usage (from a checkout, after ``make install`` or with the ``examples`` extra:
flax and orbax-checkpoint)::

    python examples/train_lm.py --windows 200 --out /tmp/lm0
    python examples/train_lm.py --windows 200 --out /tmp/lm --stop-after 301
    python examples/train_lm.py --windows 200 --out /tmp/lm --resume
    JAX_NUM_CPU_DEVICES=4 python examples/train_lm.py --devices 4 --out /tmp/lm4

The data of window ``w`` (counted from 0) are drawn from a generator seeded
with ``(seed, 1, w)``,
so the data position is just the number of microbatches done, which the
checkpoint stores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
from collections.abc import Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
    import orbax.checkpoint as ocp
    from flax import nnx
except ImportError as error:  # flax, and orbax-checkpoint, which flax requires
    raise SystemExit(
        f"{error}: this example needs flax and orbax-checkpoint; run `make "
        "install` (or `pip install -e '.[examples]'`) first"
    ) from None

import masked_multistep as mm
from masked_multistep.demo.cli import unwritable
from masked_multistep.demo.data import (
    Batches,
    Corpus,
    arrange,
    make_corpus,
    sample_sequences,
    to_batches,
)

# --------------------------------------------------------------------------- model


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads, d_model, decode=False, keep_rngs=False, rngs=rngs
        )
        self.mlp_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array, causal_mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), mask=causal_mask)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Token and learned position embeddings, blocks, a tied output layer.

    Maps ``(batch, seq_len)`` tokens to ``(batch, seq_len, vocab_size)`` logits;
    position ``t`` sees tokens ``0..t`` only (sequences are right-padded, so a
    real token never attends to padding).
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        d = config.d_model
        self.embed = nnx.Embed(config.vocab_size, d, rngs=rngs)
        self.positions = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (config.seq_len, d))
        )
        self.blocks = nnx.List(
            [Block(d, config.num_heads, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.positions[None, : tokens.shape[-1]]
        causal_mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, causal_mask)
        return self.embed.attend(self.final_norm(x))


def _plural(n: int, word: str) -> str:
    """``1 window``, ``2 windows``, ``4 microbatches``."""
    return (
        f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('h') else 's'}"
    )


def loss_fn(model: TransformerLM, inputs, targets, mask):
    """Next-token cross-entropy averaged over the real tokens, and their count."""
    losses = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets)
    return mm.masked_mean(losses, mask)


@nnx.jit
def train_step(model, optimizer, inputs, targets, mask):
    """One microbatch: its mean gradient and token count go to the optimizer.

    The params change only on the window's last microbatch, where the inner
    optimizer runs once on the token-weighted mean of the window's gradients.
    """
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, count), grads = grad_fn(model, inputs, targets, mask)
    optimizer.update(model, grads, count=count, value=loss)


@functools.cache
def data_parallel_train_step(mesh: jax.sharding.Mesh):
    """``train_step`` with the microbatch's rows split over ``mesh``'s devices.

    Every device computes the mean gradient and token count of its own rows;
    they reach the optimizer stacked along a leading device axis, and no
    gradient crosses devices until the window closes.
    """

    @nnx.jit
    def step(model, optimizer, inputs, targets, mask):
        graphdef, params = nnx.split(model, nnx.Param)

        def param_loss_fn(params, microbatch):
            return loss_fn(nnx.merge(graphdef, params), *microbatch)

        grad_fn = mm.per_device_value_and_grad(param_loss_fn, mesh, "data")
        (loss, count), grads = grad_fn(params, (inputs, targets, mask))
        optimizer.update(model, grads, count=count, value=loss)

    return step


@nnx.jit
def eval_loss(model, inputs, targets, mask):
    return loss_fn(model, inputs, targets, mask)[0]


# ---------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Config:
    """What defines a run: a resumed run must use the same values."""

    windows: int = 200
    microbatches: int = 4
    batch_size: int = 32
    seq_len: int = 64
    vocab_size: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    learning_rate: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    skew: float = 1.0
    seed: int = 0
    devices: int = 1


HELP = {
    "windows": "optimizer updates (windows of k microbatches) to train for",
    "microbatches": "microbatches per window (k)",
    "batch_size": "sequences per window, split into k microbatches",
    "seq_len": "model input length (tokens)",
    "vocab_size": "token ids, padding and topic markers included (8 to 8192)",
    "d_model": "model width",
    "num_heads": "attention heads",
    "num_layers": "transformer blocks",
    "learning_rate": "peak learning rate of the warmup-cosine schedule",
    "warmup": "windows of linear warmup, the learning rate rising from 0 (the "
    "first window's) to the peak, then cosine decay to 10%% of the peak; the "
    "default shrinks to --windows - 1 where that is smaller, a value given must "
    "be below --windows",
    "weight_decay": "adamw weight decay",
    "clip_norm": "clip each window's full-batch gradient to this global norm",
    "skew": "length skew between microbatches: 0 = random, 1 = sorted by length "
    "(the logged noise scale B_simple assumes exchangeable microbatches: read it "
    "with --skew 0; above 0 it is biased, and often n/a)",
    "seed": "data and initialisation seed",
    "devices": "data-parallel devices, each with its own running mean, reduced once "
    "per window (on CPU, run with JAX_NUM_CPU_DEVICES=N; the logged noise scale "
    "then counts each device's share as a microbatch); --resume may change it",
}


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (``--warmup``'s
    default shrinks to fit a short run; a value given must fit)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/train_lm.py",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        kind = type(field.default)
        parser.add_argument(
            flag,
            type=kind,
            default=field.default,
            help=HELP[field.name],
            **({"action": _Given} if field.name == "warmup" else {}),
        )
    parser.add_argument(
        "--out",
        default="train-lm-output",
        help="output directory: checkpoints, and metrics.jsonl (a line per window: "
        "loss, tokens, rate, noise scale, gradient norm in all and by layer)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="save every N windows (and at the end), in --out/checkpoints/M, M "
        "the microbatches done",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --out (start afresh if none)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="save a checkpoint and stop after this many microbatches in all "
        "(may be mid-window), as a preemption handler would",
    )
    parser.add_argument(
        "--eval-sequences", type=int, default=256, help="held-out sequences"
    )
    return parser


# The largest --vocab-size: the corpus's transition tables take 4 x vocab²
# float64s (2 GiB here).
MAX_VOCAB = 8192


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    positive = ["windows", "microbatches", "batch_size", "seq_len", "d_model"]
    positive += ["num_heads", "num_layers", "checkpoint_every", "eval_sequences"]
    positive += ["devices"]
    for name in positive:
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.batch_size % args.microbatches:
        parser.error(
            f"--batch-size ({args.batch_size}) must be divisible by "
            f"--microbatches ({args.microbatches})"
        )
    if (args.batch_size // args.microbatches) % args.devices:
        parser.error(
            f"a microbatch's {args.batch_size // args.microbatches} sequence(s) "
            f"(--batch-size / --microbatches) must split evenly over --devices "
            f"{args.devices}"
        )
    if args.devices > len(jax.devices()):
        parser.error(
            f"--devices {args.devices}: only {len(jax.devices())} "
            f"{jax.default_backend()} device(s) here (on CPU, set "
            f"JAX_NUM_CPU_DEVICES={args.devices})"
        )
    if args.d_model % args.num_heads:
        parser.error(
            f"--d-model ({args.d_model}) must be divisible by --num-heads "
            f"({args.num_heads})"
        )
    if not vars(args).pop("warmup_given", False):
        args.warmup = min(args.warmup, args.windows - 1)
    if not 0 <= args.warmup < args.windows:
        parser.error(
            f"--warmup must be in [0, --windows), got {args.warmup} "
            f"with --windows {args.windows}"
        )
    if not 0.0 <= args.skew <= 1.0:
        parser.error(f"--skew must be between 0 and 1, got {args.skew}")
    if not 0 <= args.seed < 2**32:  # jax.random.key keeps a seed's low 32 bits
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if not 8 <= args.vocab_size <= MAX_VOCAB:
        # (The corpus's transition tables are dense: 4 x vocab² floats.)
        parser.error(f"--vocab-size must be in [8, {MAX_VOCAB}], got {args.vocab_size}")
    # Written so that NaN fails too (every comparison with it is false).
    if not args.clip_norm > 0:
        parser.error(f"--clip-norm must be > 0, got {args.clip_norm}")
    if not 0 < args.learning_rate < math.inf:
        parser.error(
            f"--learning-rate must be > 0 and finite, got {args.learning_rate}"
        )
    if not 0 <= args.weight_decay < math.inf:
        parser.error(f"--weight-decay must be >= 0 and finite, got {args.weight_decay}")
    out = pathlib.Path(args.out)
    if not args.out or (out.exists() and not out.is_dir()):
        parser.error(f"--out must name a directory, got {args.out!r}")
    if problem := unwritable(args.out):  # said now, not after the first windows
        parser.error(f"--out {args.out!r}: {problem}")
    if args.stop_after is not None and args.stop_after < 1:
        parser.error(f"--stop-after must be >= 1, got {args.stop_after}")
    return args


# -------------------------------------------------------------------------- data


@functools.cache
def make_mesh(devices: int) -> jax.sharding.Mesh | None:
    """The first ``devices`` devices along one ``"data"`` axis (``None`` for 1)."""
    if devices == 1:
        return None
    return jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )


@functools.cache
def make_optimizer(config: Config, deferred: bool = False) -> mm.MaskedMultiSteps:
    """Clip and adamw *inside* the wrapper: both act on the full-batch gradient.

    The schedule's step is the inner optimizer's count, which advances once per
    update, so ``--warmup`` and the decay are in windows (a window without
    tokens applies no update and does not advance it). The wrapper keeps the
    window statistics (loss, tokens, noise scale) that the log reads. With
    ``--devices`` above 1 each device keeps its own running mean (a leading
    device axis on the accumulator), and the devices combine them, weighted by
    their tokens, when the window closes (``deferred``: also on one device,
    for the layout of a state saved on several). (Cached: the optimizer is
    part of the compiled step's static structure, so runs with the same
    settings in one process share one compilation.)
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup,
        decay_steps=config.windows,
        end_value=0.1 * config.learning_rate,
    )
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=config.weight_decay
    )
    inner = optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)
    mesh = make_mesh(config.devices)
    if mesh is None and deferred:
        mesh = jax.make_mesh(
            (1,),
            ("data",),
            axis_types=(jax.sharding.AxisType.Auto,),
            devices=jax.devices()[:1],
        )
    return mm.MaskedMultiSteps(
        inner,
        every_k_schedule=config.microbatches,
        window_stats=True,
        per_leaf_stats=True,  # each layer's share of the window statistics
        reduction=None if mesh is None else mm.deferred(mesh, "data"),
    )


def layer_labels(grads):
    """Each gradient leaf's layer: ``embed``, ``positions``, ``blocks.0``,
    ``blocks.1``, ..., ``final_norm`` (for ``mm.window_stats(groups=)``)."""

    def label(path, _):
        top = str(path[0].key)
        return f"{top}.{path[1].key}" if top == "blocks" else top

    return jax.tree_util.tree_map_with_path(label, grads)


def learning_rate_used(optimizer: nnx.Optimizer) -> float:
    """The learning rate of the last inner update (``inject_hyperparams`` state)."""
    adamw_state = optimizer.opt_state.inner_opt_state[1]  # the chain's second part
    return float(adamw_state.hyperparams["learning_rate"][...])


def window_batch(corpus: Corpus, config: Config, window: int) -> Batches:
    """Window ``window``'s batch, sorted by length according to ``--skew``."""
    rng = np.random.default_rng([config.seed, 1, window])
    tokens, lengths = sample_sequences(rng, corpus, config.batch_size)
    return to_batches(tokens[arrange(rng, lengths, config.skew)])


def microbatch(batch: Batches, index: int, k: int) -> Batches:
    """The ``index``-th of ``k`` consecutive slices: short sequences first."""
    size = len(batch.inputs) // k
    return Batches(*(x[index * size : (index + 1) * size] for x in batch))


def place_on_mesh(mesh: jax.sharding.Mesh, model, optimizer) -> None:
    """Replicates every array of ``model`` and ``optimizer`` over ``mesh``.

    The accumulator is already there (``tx.init`` lays its device axis over the
    mesh); the params, adamw's moments and the step counters are replicated,
    so that checkpoints restore onto the mesh, not onto one device.
    """
    replicated = NamedSharding(mesh, P())

    def place(x):
        on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else jax.device_put(x, replicated)

    nnx.update(model, jax.tree.map(place, nnx.state(model)))
    nnx.update(optimizer, jax.tree.map(place, nnx.state(optimizer)))


def window_record(window: int, optimizer: nnx.Optimizer) -> dict:
    """The log of the window that just closed, from the optimizer state.

    ``None`` where undefined or not finite (JSON has no NaN): a window
    without tokens has no loss; a window without tokens or with a non-finite
    gradient (a diverged run, whose loss is NaN too) applies no update and so
    used no learning rate; the smoothed noise scale is undefined until a window
    resolves the gradient from its noise, and again whenever the noise swamps
    the gradient (the averaged |G|² estimate is not positive: late in training
    with length-sorted microbatches, for one).
    """
    stats = mm.window_stats(optimizer.opt_state)
    updated = bool(mm.has_updated(optimizer.opt_state))
    tokens = int(stats.tokens)

    def finite(x) -> float | None:
        x = float(x)
        return x if np.isfinite(x) else None

    layers = mm.window_stats(optimizer.opt_state, groups=layer_labels)
    return {
        "window": window,
        "loss": finite(stats.loss) if tokens else None,
        "tokens": tokens,
        "learning_rate": finite(learning_rate_used(optimizer)) if updated else None,
        "smoothed_noise_scale": finite(stats.smoothed_noise_scale),
        "grad_norm": finite(np.sqrt(stats.grad_sq_norm)) if tokens else None,
        "layer_grad_norms": {
            name: finite(np.sqrt(sq)) if tokens else None
            for name, sq in layers.grad_sq_norm.items()
        },
    }


# -------------------------------------------------------------------- checkpoints


def save(manager, microbatches_done, model, optimizer, config):
    """Model, optimizer state (pending window included) and position."""
    meta = {
        "microbatches_done": microbatches_done,
        "config": dataclasses.asdict(config),
    }
    manager.save(
        microbatches_done,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)),
            optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
            meta=ocp.args.JsonSave(meta),
        ),
    )


def restore(manager, model, optimizer, config, print_fn=print) -> int:
    """Restores the latest readable checkpoint into ``model`` and ``optimizer``.

    A checkpoint that cannot be read (cut short by a crash, damaged) is
    reported and the one before it tried; once one is restored, the unreadable
    ones after it are deleted (the run saves those steps again). Returns the
    number of microbatches done.
    """
    failures = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            restored = _restore_step(manager, step, model, optimizer, config)
        except Exception as err:  # noqa: BLE001 - orbax raises many kinds
            failures.append(f"checkpoint {step}: {type(err).__name__}: {err}")
            print_fn(f"--resume: cannot read {failures[-1]}; trying an earlier one")
            continue
        for bad in manager.all_steps():
            if bad > step:
                manager.delete(bad)
                print_fn(f"--resume: deleted the unreadable checkpoint {bad}")
        return restored
    raise SystemExit(
        "--resume: no readable checkpoint in "
        f"{manager.directory}:\n" + "\n".join(failures)
    )


def _as_saved(config, saved_devices, model, optimizer):
    """The optimizer state laid out as a run on ``saved_devices`` devices saved
    it: the tree to restore the checkpoint into, on this run's devices."""
    if saved_devices == config.devices:
        return nnx.state(optimizer)
    if saved_devices > 1 and config.devices > 1:
        return mm.device_count_target(nnx.state(optimizer), saved_devices)
    if saved_devices == 1:  # one device, no reduction
        tx = make_optimizer(dataclasses.replace(config, devices=1))
    else:  # onto one device: a deferred wrapper on it has the saved layout
        tx = make_optimizer(config, deferred=True)
    like_saved = nnx.state(nnx.Optimizer(model, tx, wrt=nnx.Param))
    if saved_devices == 1:
        return like_saved
    return mm.device_count_target(like_saved, saved_devices)


def _restore_step(manager, step, model, optimizer, config) -> int:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    saved = meta["meta"]["config"]
    # Any setting but the number of devices defines the run.
    changed = [
        k
        for k, v in dataclasses.asdict(config).items()
        if saved[k] != v and k != "devices"
    ]
    if changed:
        flags = ", ".join(
            f"--{k.replace('_', '-')} {saved[k]} (now {getattr(config, k)})"
            for k in changed
        )
        raise SystemExit(f"--resume: the checkpoint was trained with {flags}")
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract(nnx.state(model))),
            optimizer=ocp.args.StandardRestore(
                abstract(_as_saved(config, saved["devices"], model, optimizer))
            ),
        ),
    )
    nnx.update(model, restored["model"])
    opt_state = restored["optimizer"]
    if saved["devices"] != config.devices:
        # The pending window's running means, regrouped onto this run's devices.
        opt_state = mm.from_device_count(opt_state, nnx.state(optimizer))
    nnx.update(optimizer, opt_state)
    return meta["meta"]["microbatches_done"]


# ------------------------------------------------------------------------- train


@dataclasses.dataclass
class Result:
    model: TransformerLM
    optimizer: nnx.Optimizer
    microbatches_done: int
    heldout_loss: float | None


def train(args: argparse.Namespace, print_fn=print) -> Result:
    config = Config(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}
    )
    out = pathlib.Path(args.out).absolute()
    k = config.microbatches
    total = config.windows * k
    corpus = make_corpus(
        np.random.default_rng([config.seed, 0]),
        vocab_size=config.vocab_size,
        seq_len=config.seq_len,
    )

    model = TransformerLM(config, rngs=nnx.Rngs(config.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    mesh = make_mesh(config.devices)
    if mesh is None:
        step_fn = train_step
    else:
        place_on_mesh(mesh, model, optimizer)
        step_fn = data_parallel_train_step(mesh)
        rows = NamedSharding(mesh, P("data"))

    manager = ocp.CheckpointManager(
        out / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=3)
    )
    metrics = out / "metrics.jsonl"
    done = 0
    if manager.latest_step() is not None:
        if not args.resume:
            raise SystemExit(
                f"{out} already holds checkpoints: pass --resume to continue "
                "that run, or choose another --out"
            )
        done = restore(manager, model, optimizer, config, print_fn)
        print_fn(
            f"resumed after {done} microbatches ({_plural(done // k, 'window')} + "
            f"{done % k})"
        )
        # Drop the log lines of windows after the checkpoint: they run again.
        # (A line cut short by a crash while it was written belongs to a
        # window after the checkpoint too: the log is written before the save.)
        lines = (
            metrics.read_text(encoding="utf-8").splitlines() if metrics.exists() else []
        )
        kept = [s for s in lines if _window_of(s) <= done // k]
        metrics.write_text("".join(s + "\n" for s in kept), encoding="utf-8")
    else:
        if args.resume:
            print_fn(
                f"--resume: NO CHECKPOINT in {out} (is --out right?): starting afresh"
            )
        if metrics.exists():
            metrics.unlink()

    print_fn(
        f"{_plural(config.windows, 'window')} of {_plural(k, 'microbatch')} "
        f"({config.batch_size} sequences a window); learning rate: "
        f"{_plural(config.warmup, 'window')} of warmup to "
        f"{config.learning_rate:g}, then cosine decay"
        + (
            f"; --skew {config.skew:g} orders microbatches by length, which biases "
            "the logged noise scale (measure it with --skew 0)"
            if config.skew > 0
            else ""
        )
    )
    stop = total if args.stop_after is None else min(args.stop_after, total)
    if stop < done:
        print_fn(
            f"--stop-after {stop} is before the checkpoint's {done} microbatches: "
            "nothing to run"
        )
        stop = done
    batch = None
    for step in range(done, stop):
        window, index = divmod(step, k)
        if batch is None or index == 0:
            batch = window_batch(corpus, config, window)
        inputs = microbatch(batch, index, k)
        if mesh is not None:
            # One process holds the whole batch here. On several hosts each
            # process holds its own rows: build the global array with
            # jax.make_array_from_process_local_data (README, "Multi-device and
            # multi-host"), and log and write files from process 0 only.
            inputs = jax.device_put(inputs, rows)
        # No host round trip: the loss and count stay in the optimizer state.
        step_fn(model, optimizer, *inputs)

        if index == k - 1:  # the window closes, with its update
            record = window_record(window + 1, optimizer)
            loss, rate = record["loss"], record["learning_rate"]
            loss_text = "   n/a" if loss is None else f"{loss:.4f}"
            lr_text = "(no update)" if rate is None else f"{rate:.2e}"
            scale = record["smoothed_noise_scale"]
            scale_text = "n/a" if scale is None else f"{scale:.3g}"
            print_fn(
                f"window {record['window']:5d}  loss {loss_text}  "
                f"tokens {record['tokens']:6d}  lr {lr_text}  "
                f"B_simple (smoothed) {scale_text}"
            )
            with metrics.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")
        periodic = index == k - 1 and (window + 1) % args.checkpoint_every == 0
        if periodic or step + 1 == stop:
            save(manager, step + 1, model, optimizer, config)
    if stop < total:
        print_fn(f"stopped after {stop} microbatches: continue with --resume")
    manager.wait_until_finished()
    manager.close()

    heldout_loss = None
    if stop == total:
        tokens, _ = sample_sequences(
            np.random.default_rng([config.seed, 2]), corpus, args.eval_sequences
        )
        heldout_loss = float(eval_loss(model, *to_batches(tokens)))
        print_fn(
            f"held-out loss {heldout_loss:.4f} after "
            f"{_plural(config.windows, 'window')}"
        )
    return Result(model, optimizer, stop, heldout_loss)


def _window_of(line: str) -> float:
    """The window a ``metrics.jsonl`` line logs (infinity if it is cut short)."""
    try:
        return json.loads(line)["window"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def main(argv: Sequence[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
