"""``examples/train_lm.py`` trains, and a run resumed mid-window is bit-identical.

The script runs in this process (``train(parse_args(argv))``) three times on a
short configuration: once straight through, then stopped after a microbatch in
the middle of a window (its checkpoint holds a half-accumulated window) and
resumed with ``--resume``. Every parameter, the whole optimizer state, every
window's logged loss and the held-out loss must be equal bit for bit: the
resumed run restores the exact arrays, draws the same data (seeded per window)
and runs the same compiled step, so nothing is allowed to differ. With
``--devices 4`` (data parallel, one reduction per window) the run matches the
one-device run to float32 rounding and resumes on the mesh bit for bit too.
"""

import importlib.util
import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

PATH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
_spec = importlib.util.spec_from_file_location("train_lm", PATH)
train_lm = importlib.util.module_from_spec(_spec)
sys.modules["train_lm"] = train_lm  # dataclasses look their module up there
_spec.loader.exec_module(train_lm)

K = 4
WINDOWS = 5
STOP_AFTER = 10  # two windows and two of the third window's four microbatches
SMALL = [
    *("--windows", str(WINDOWS), "--microbatches", str(K), "--batch-size", "16"),
    *("--seq-len", "24", "--d-model", "32", "--num-layers", "1", "--warmup", "2"),
    *("--checkpoint-every", "2", "--eval-sequences", "64"),
]


def run(out, *flags):
    lines = []
    args = train_lm.parse_args([*SMALL, "--out", str(out), *flags])
    return train_lm.train(args, print_fn=lines.append), lines


def arrays(result):
    """Every array of the model and the optimizer, as numpy."""
    state = (nnx.state(result.model), nnx.state(result.optimizer))
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def records(out):
    return [
        json.loads(s)
        for s in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The short configuration on one device, uninterrupted: result, log, out."""
    out = tmp_path_factory.mktemp("straight")
    result, log = run(out)
    return result, log, out


@pytest.mark.slow
def test_resume_from_a_mid_window_checkpoint_is_bit_identical(tmp_path, straight_run):
    straight, log, straight_out = straight_run
    assert len([s for s in log if s.startswith("window")]) == WINDOWS
    history = records(straight_out)
    assert [r["window"] for r in history] == list(range(1, WINDOWS + 1))
    assert all(r["tokens"] > 0 for r in history)
    # Warmup from 0 over 2 windows, then cosine decay: the rate each update used.
    rates = [r["learning_rate"] for r in history]
    assert rates[0] == 0.0 and rates[2] == pytest.approx(3e-3)
    assert rates[2] > rates[3] > rates[4] > 3e-4
    # It learns: the held-out loss ends below the first window's loss.
    assert straight.heldout_loss < history[0]["loss"] - 0.1
    # The smoothed noise scale, from the window statistics, in tokens.
    assert all(r["smoothed_noise_scale"] > 0 for r in history)
    # The window's gradient norm, and each layer's, whose squares add up to it.
    for r in history:
        layers = r["layer_grad_norms"]
        assert set(layers) == {"embed", "positions", "blocks.0", "final_norm"} | {
            f"blocks.{i}" for i in range(len(layers) - 3)
        }
        total = np.sqrt(sum(x**2 for x in layers.values()))
        assert total == pytest.approx(r["grad_norm"], rel=1e-4)

    out = tmp_path / "resumed"
    first, log = run(out, "--stop-after", str(STOP_AFTER))
    state = first.optimizer.opt_state
    assert first.microbatches_done == STOP_AFTER
    assert int(state.mini_step[...]) == STOP_AFTER % K == 2  # mid-window
    assert int(state.acc_count[...]) > 0
    assert int(state.gradient_step[...]) == STOP_AFTER // K
    assert first.heldout_loss is None
    with pytest.raises(SystemExit, match="pass --resume"):
        run(out)
    with pytest.raises(SystemExit, match="--learning-rate 0.003 \\(now 0.1\\)"):
        run(out, "--resume", "--learning-rate", "0.1")

    # A stop before the checkpoint runs nothing and says so.
    early, log = run(out, "--resume", "--stop-after", "5")
    assert log[-2:] == [
        "--stop-after 5 is before the checkpoint's 10 microbatches: nothing to run",
        "stopped after 10 microbatches: continue with --resume",
    ]
    assert early.microbatches_done == STOP_AFTER

    second, log = run(out, "--resume")
    assert log[0] == "resumed after 10 microbatches (2 windows + 2)"
    assert second.microbatches_done == WINDOWS * K
    assert records(out) == history  # the same floats, not just close ones
    assert second.heldout_loss == straight.heldout_loss
    expected, got = arrays(straight), arrays(second)
    assert len(got) == len(expected)
    for want, have in zip(expected, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(have, want)


@pytest.mark.slow
def test_data_parallel_matches_one_device_and_resumes_bit_identically(
    tmp_path, straight_run
):
    # --devices 4: each device accumulates its rows' running mean, and the
    # devices combine them once per window. The same windows and losses as on
    # one device, to float32 rounding; a mid-window checkpoint of the
    # per-device state restores onto the mesh and continues bit for bit.
    single, _, single_out = straight_run
    parallel, _ = run(tmp_path / "parallel", "--devices", "4")
    state = parallel.optimizer.opt_state
    mesh_devices = set(jax.devices()[:4])
    for leaf in jax.tree.leaves(state.acc_grads):
        assert leaf.shape[0] == 4 and leaf.sharding.device_set == mesh_devices
        assert leaf.addressable_shards[0].data.shape[0] == 1  # one mean per device
    for leaf in jax.tree.leaves(
        (nnx.state(parallel.model), nnx.state(parallel.optimizer))
    ):
        assert leaf.sharding.device_set == mesh_devices
    one, four = records(single_out), records(tmp_path / "parallel")
    assert [r["tokens"] for r in four] == [r["tokens"] for r in one]
    assert [r["learning_rate"] for r in four] == [r["learning_rate"] for r in one]
    for a, b in zip(one, four, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert parallel.heldout_loss == pytest.approx(single.heldout_loss, rel=1e-5)
    # Every parameter moved the same way, to float32 rounding, but one: the
    # attention's key bias, whose gradient is 0 in exact arithmetic (softmax
    # ignores a constant added to all of a query's scores), so both runs hand
    # adam rounding noise, which it scales to steps of up to the learning rate.
    args = train_lm.parse_args(SMALL)
    config = train_lm.Config(**{k: getattr(args, k) for k in vars(train_lm.Config())})
    init = train_lm.TransformerLM(config, rngs=nnx.Rngs(config.seed))
    leaves = (
        jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        for model in (init, single.model, parallel.model)
    )
    for (path, start), (_, a), (_, b) in zip(*leaves, strict=True):
        if "'key']['bias']" in jax.tree_util.keystr(path):
            continue
        moved, apart = np.linalg.norm(a - start), np.linalg.norm(b - a)
        assert apart <= 1e-4 * moved, jax.tree_util.keystr(path)

    out = tmp_path / "resumed"
    first, _ = run(out, "--devices", "4", "--stop-after", str(STOP_AFTER))
    assert int(first.optimizer.opt_state.mini_step[...]) == STOP_AFTER % K == 2
    # Onto 2 devices: the pending window's 4 running means are regrouped
    # (mm.from_device_count), and the run ends as on 4, to float32 rounding.
    moved_out = tmp_path / "moved"
    shutil.copytree(out, moved_out)
    moved, log = run(moved_out, "--resume", "--devices", "2")
    assert log[0] == "resumed after 10 microbatches (2 windows + 2)"
    assert [r["tokens"] for r in records(moved_out)] == [r["tokens"] for r in four]
    for a, b in zip(four, records(moved_out), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert moved.heldout_loss == pytest.approx(parallel.heldout_loss, rel=1e-5)
    for leaf in jax.tree.leaves(moved.optimizer.opt_state.acc_grads):
        assert leaf.shape[0] == 2 and len(leaf.sharding.device_set) == 2
    second, log = run(out, "--resume", "--devices", "4")
    assert log[0] == "resumed after 10 microbatches (2 windows + 2)"
    assert records(out) == four
    assert second.heldout_loss == parallel.heldout_loss
    for want, have in zip(arrays(parallel), arrays(second), strict=True):
        np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "10"], "--batch-size (10) must be divisible"),
        (["--warmup", "5"], "--warmup must be in [0, --windows)"),
        (["--windows", "0"], "--windows must be >= 1, got 0"),
        (["--skew", "1.5"], "--skew must be between 0 and 1"),
        (["--clip-norm", "0"], "--clip-norm must be > 0"),
        # A negative rate trained uphill.
        (["--learning-rate", "-1"], "--learning-rate must be > 0 and finite, got -1.0"),
        (
            ["--weight-decay", "-0.1"],
            "--weight-decay must be >= 0 and finite, got -0.1",
        ),
        # NaN passed every `<` check: a traceback after training, or a silent
        # run of NaN updates.
        (["--learning-rate", "nan"], "--learning-rate must be > 0 and finite, got nan"),
        (["--weight-decay", "nan"], "--weight-decay must be >= 0 and finite, got nan"),
        (["--clip-norm", "nan"], "--clip-norm must be > 0, got nan"),
        (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
        (["--seed", str(2**32)], "--seed must be in [0, 2**32), got 4294967296"),
        (["--devices", "0"], "--devices must be >= 1, got 0"),
        (["--devices", "3"], "sequence(s) (--batch-size / --microbatches) must split"),
        # The split is checked first: it is the one to fix on any machine.
        (["--devices", "9"], "4 sequence(s) (--batch-size / --microbatches) must"),
        (
            ["--devices", "16", "--batch-size", "64"],
            "--devices 16: only 8 cpu device(s) here",
        ),
        # A file as --out failed in orbax after the model was built.
        (["--out", __file__], "--out must name a directory"),
        (["--out", ""], "--out must name a directory, got ''"),
        # Under a file: orbax's NotADirectoryError, not naming the flag.
        (["--out", f"{__file__}/sub"], "cannot be created: "),
        # numpy's MemoryError for a 298 GiB transition table.
        (["--vocab-size", "100000"], "--vocab-size must be in [8, 8192], got 100000"),
    ],
)
def test_bad_flags_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_args([*SMALL, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


TINY = [
    *("--windows", "3", "--warmup", "1", "--microbatches", "1", "--batch-size", "1"),
    *(
        "--seq-len",
        "2",
        "--d-model",
        "16",
        "--num-layers",
        "1",
        "--eval-sequences",
        "8",
    ),
]


@pytest.fixture(scope="module")
def twelve_tiny_windows(tmp_path_factory):
    """12 windows of sequences of 2 tokens (some windows hold none), a
    checkpoint every 5 windows, and a --stop-after past the run's end."""
    out = tmp_path_factory.mktemp("twelve")
    flags = [*TINY, "--windows", "12", "--checkpoint-every", "5"]
    lines = []
    result = train_lm.train(
        train_lm.parse_args([*flags, "--stop-after", "100", "--out", str(out)]),
        print_fn=lines.append,
    )
    return out, lines, result


@pytest.mark.slow
def test_a_window_without_tokens_logs_no_loss_and_no_rate(twelve_tiny_windows):
    # Such a window applies no update; it logged "loss 0.0000" and the
    # previous update's rate.
    out, lines, result = twelve_tiny_windows
    history = records(out)
    empty = [r for r in history if r["tokens"] == 0]
    assert empty, "the seed gives windows without tokens"
    assert all(r["loss"] is None and r["learning_rate"] is None for r in empty)
    assert all(r["grad_norm"] is None for r in empty)
    assert all(x is None for r in empty for x in r["layer_grad_norms"].values())
    assert all(
        r["loss"] > 0 and r["learning_rate"] is not None for r in history if r["tokens"]
    )
    assert int(result.optimizer.opt_state.gradient_step[...]) == 12 - len(empty)
    assert sum("loss    n/a" in s and "(no update)" in s for s in lines) == len(empty)


@pytest.mark.slow
def test_checkpoints_fall_every_n_windows_and_a_late_stop_after_ends_the_run(
    twelve_tiny_windows,
):
    # A checkpoint after windows 5 and 10 and at the end; a --stop-after past
    # the last microbatch stops where the run ends, with its held-out loss.
    out, lines, result = twelve_tiny_windows
    ckpts = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir()) == [5, 10, 12]
    assert result.microbatches_done == 12 and result.heldout_loss is not None
    assert [r["window"] for r in records(out)] == list(range(1, 13))
    assert not any(s.startswith("stopped after") for s in lines)


@pytest.mark.slow
def test_a_diverged_run_logs_null_not_nan(tmp_path):
    # A learning rate of 1e20 makes the params non-finite after window 2: the
    # later windows have tokens but a NaN loss and apply no update. JSON has no
    # NaN (strict parsers refuse the line): the log says null.
    flags = [*TINY, "--seq-len", "8", "--windows", "4", "--learning-rate", "1e20"]
    lines = []
    train_lm.train(
        train_lm.parse_args([*flags, "--out", str(tmp_path)]), print_fn=lines.append
    )

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    text = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    history = [json.loads(s, parse_constant=refuse) for s in text]
    assert [r["tokens"] > 0 for r in history] == [True] * 4
    assert [r["loss"] is None for r in history] == [False, False, True, True]
    assert [r["learning_rate"] is None for r in history] == [False, False, True, True]
    assert sum("loss    n/a" in s for s in lines) == 2


@pytest.mark.slow
def test_resume_skips_an_unreadable_checkpoint(tmp_path):
    # The twelve tiny windows' settings (the same compiled steps), stopped early.
    flags = [*TINY, "--windows", "12", "--checkpoint-every", "1"]
    flags += ["--out", str(tmp_path)]
    first = train_lm.train(train_lm.parse_args([*flags, "--stop-after", "3"]), print)
    ckpts = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir()) == [1, 2, 3]
    (ckpts / "3" / "meta" / "metadata").unlink()  # cut short by a crash
    with (tmp_path / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write('{"window": 4, "lo')  # so was the log line being written
    lines = []
    again = train_lm.train(
        train_lm.parse_args([*flags, "--resume", "--stop-after", "4"]), lines.append
    )
    assert [r["window"] for r in records(tmp_path)] == [1, 2, 3, 4]
    assert lines[0].startswith("--resume: cannot read checkpoint 3: FileNotFoundError")
    assert lines[1:3] == [
        "--resume: deleted the unreadable checkpoint 3",
        "resumed after 2 microbatches (2 windows + 0)",
    ]
    assert again.microbatches_done == 4 and first.microbatches_done == 3
    # Nothing readable: one message that lists every checkpoint's failure.
    assert sorted(int(p.name) for p in ckpts.iterdir()) == [2, 3, 4]  # 3 kept
    for step in (2, 3, 4):
        (ckpts / str(step) / "meta" / "metadata").unlink()
    with pytest.raises(
        SystemExit,
        match="no readable checkpoint in .*\\ncheckpoint 4: FileNotFoundError",
    ):
        train_lm.train(train_lm.parse_args([*flags, "--resume"]), lines.append)


def _small_config_and_corpus():
    from masked_multistep.demo.data import make_corpus

    args = train_lm.parse_args(SMALL)
    config = train_lm.Config(**{k: getattr(args, k) for k in vars(train_lm.Config())})
    corpus = make_corpus(
        np.random.default_rng([config.seed, 0]),
        vocab_size=config.vocab_size,
        seq_len=config.seq_len,
    )
    return config, corpus


def test_a_windows_microbatches_run_from_short_to_long_and_cover_its_batch():
    config, corpus = _small_config_and_corpus()
    batch = train_lm.window_batch(corpus, config, 0)
    parts = [train_lm.microbatch(batch, i, K) for i in range(K)]
    for whole, *pieces in zip(batch, *parts, strict=True):
        np.testing.assert_array_equal(np.concatenate(pieces), whole)
    # --skew 1 (the default): the first microbatch holds the short sequences.
    tokens = [int(part.mask.sum()) for part in parts]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1]


def test_every_window_draws_a_batch_of_its_own_and_the_same_one_again_on_resume():
    config, corpus = _small_config_and_corpus()
    first, again, second = (
        train_lm.window_batch(corpus, config, w).inputs for w in (0, 0, 1)
    )
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, second)


def test_the_run_says_its_schedule_and_the_skews_bias_first(twelve_tiny_windows):
    _, lines, _ = twelve_tiny_windows
    (first,) = [s for s in lines if "windows of" in s and "learning rate" in s]
    assert lines.index(first) == 0, lines[:3]
    assert "1 window of warmup" in first, first
    assert "--skew 1 orders microbatches by length, which biases" in first, first


def test_the_default_warmup_fits_a_short_run():
    # `--windows 6` alone failed: the default warmup of 10 windows did not fit.
    assert train_lm.parse_args(["--windows", "6"]).warmup == 5
    assert train_lm.parse_args([]).warmup == train_lm.Config.warmup
    assert train_lm.parse_args(["--windows", "6", "--warmup", "2"]).warmup == 2
    with pytest.raises(SystemExit):  # a warmup given must fit
        train_lm.parse_args(["--windows", "6", "--warmup", "6"])


def test_without_orbax_the_example_says_what_to_install():
    # Without orbax-checkpoint (or flax, an optional dependency of the
    # package) the script exits with the install command instead of an import
    # traceback.
    import subprocess

    blocked = (
        "import sys, runpy; sys.modules['orbax'] = None; "
        "sys.modules['orbax.checkpoint'] = None; "
        f"sys.argv = [{str(PATH)!r}, '--help']; "
        f"runpy.run_path({str(PATH)!r}, run_name='__main__')"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1, run.stderr
    assert "orbax-checkpoint" in run.stderr and "make install" in run.stderr
    assert "Traceback" not in run.stderr
