"""The demo runs end to end and its numbers make the package's point."""

import contextlib
import io
import json
import os

import numpy as np
import pytest

from masked_multistep.demo import main
from masked_multistep.demo.data import arrange, make_batches, make_corpus


def _run_demo(out):
    """``main`` as ``make demo`` runs it but shorter: its exit status, what it
    printed (words, not lines: the notes under the table wrap where their
    numbers fall), the compiles counted when the progress bar starts and ends,
    and every :func:`mm.window_stats` the demo read."""
    import tqdm
    from _helpers import backend_compiles

    import masked_multistep as mm

    seen, read = {}, []
    window_stats, bar = mm.window_stats, tqdm.tqdm

    def recorded(state):
        read.append(window_stats(state))
        return read[-1]

    printed = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        backend_compiles() as compiles,
        contextlib.redirect_stdout(printed),
    ):
        patch.setattr(mm, "window_stats", recorded)

        def progress(iterable, **kwargs):
            seen["at_start"] = len(compiles)
            yield from bar(iterable, **kwargs)
            seen["at_end"] = len(compiles)

        patch.setattr(tqdm, "tqdm", progress)
        status = main(["--steps", "3", "--microbatches", "4", "--out", str(out)])
    return status, " ".join(printed.getvalue().split()), seen, read


def test_demo_outputs_show_masked_equals_full_batch(tmp_path):
    # One run of the demo serves every check below.
    out = tmp_path / "out"
    status, printed, seen, read = _run_demo(out)
    assert status == 0

    assert "mm.MaskedMultiSteps" in printed and "optax.MultiSteps" in printed
    assert str(out / "summary.json") in printed

    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    runs = summary["runs"]
    assert summary["config"]["steps"] == 3
    for run in runs.values():
        assert len(run["train_loss"]) == len(run["grad_rel_error"]) == 3
    # The reference measures its own gradient: exactly 0. The token-weighted
    # gradient is off by float32 rounding only, under 1e-6 as the README says.
    assert runs["full_batch"]["grad_rel_error_max"] == 0.0
    assert runs["masked_multisteps"]["grad_rel_error_max"] < 1e-6
    assert runs["optax_multisteps"]["grad_rel_error_mean"] > 0.2
    # Same initialisation: the first loss is the same for all three runs.
    first = {name: run["train_loss"][0] for name, run in runs.items()}
    assert first["full_batch"] == pytest.approx(first["optax_multisteps"], rel=1e-6)
    assert first["full_batch"] == pytest.approx(first["masked_multisteps"], rel=1e-6)
    # Masked follows the reference trajectory; optax.MultiSteps leaves it.
    ref = runs["full_batch"]
    assert runs["masked_multisteps"]["heldout_loss"] == pytest.approx(
        ref["heldout_loss"], rel=1e-4
    )
    assert abs(runs["optax_multisteps"]["heldout_loss"] - ref["heldout_loss"]) > 1e-3
    # The masked run reports the final smoothed gradient noise scale.
    assert "gradient noise scale B_simple" in printed
    noise = runs["masked_multisteps"]["smoothed_noise_scale"]
    assert (
        len(noise) == 3
        and noise[-1] == runs["masked_multisteps"]["final_smoothed_noise_scale"]
    )
    assert noise[-1] > 0
    # The first microbatch holds the short sequences, the last the long ones.
    tokens = summary["tokens_per_microbatch_first_batch"]
    assert tokens == sorted(tokens) and tokens[-1] > 4 * tokens[0]
    # The noise scale is compared with the run's batches, all of them.
    from masked_multistep.demo import train

    batches, _ = train.make_data(train.Config(**summary["config"]))
    mean = batches.mask.reshape(3, -1).sum(axis=-1).mean()
    assert summary["mean_tokens_per_batch"] == pytest.approx(mean)
    assert f"hold {mean:.0f} tokens on average" in printed
    # The footer names what it averaged: 3 steps, not "the last 10".
    assert "mean full-batch loss over the last 3 steps." in printed
    assert summary["final_train_loss_steps"] == 3
    for run in runs.values():
        assert run["final_train_loss"] == pytest.approx(np.mean(run["train_loss"]))
    assert "Length-sorted" in printed  # the default skew sorts by length

    # The step functions (and the statistics' read) compiled before the
    # progress bar, nothing while it ran: also when this test runs alone.
    assert seen["at_start"] > 0
    assert seen["at_end"] == seen["at_start"]
    # The reported noise scale is the smoothed one: one figure per step, read
    # after the step's window closed (the moving averages' ratio, which the
    # table calls "(smoothed)", not the last window's). The first read is the
    # warm-up's, of a window in progress.
    assert len(read) == 4 and int(read[0].windows) == 0
    np.testing.assert_array_equal(
        noise, [float(stats.smoothed_noise_scale) for stats in read[1:]]
    )
    assert "smoothed_noise_scale" not in runs["full_batch"]


def _summary(steps, run):
    """A demo summary of ``steps`` steps, every run's figures ``run``."""
    from masked_multistep.demo import report

    return {
        "config": {"steps": steps, "batch_size": 8, "microbatches": 2, "skew": 0.0},
        "tokens_per_microbatch_first_batch": [3, 5],
        "mean_tokens_per_batch": 8.0,
        "runs": {name: dict(run) for name in report.RUNS},
    }


def test_the_footer_follows_the_run():
    from masked_multistep.demo import report

    summary = _summary(
        1,
        {
            "grad_rel_error_mean": 0.0,
            "grad_rel_error_max": 0.0,
            "final_train_loss": 1.0,
            "heldout_loss": 1.0,
            "final_smoothed_noise_scale": 10.0,
        },
    )
    summary["runs"]["optax_multisteps"].update(
        grad_rel_error_mean=0.524, heldout_loss=1.25
    )
    summary["runs"]["masked_multisteps"]["grad_rel_error_mean"] = 3.1e-7
    text = " ".join(report.format_table(summary).split())
    assert "over the last step." in text
    assert text.startswith("1 step; batches of 8 sequences in 2 microbatches;")
    summary["config"].update(batch_size=1, microbatches=1)
    assert report.format_table(summary).startswith(
        "1 step; batches of 1 sequence in 1 microbatch;"
    )
    assert (
        "In short: optax.MultiSteps handed adam a gradient 52% off on average, "
        "mm.MaskedMultiSteps one 3.1e-07 off; held-out loss 1.2500 and 1.0000, the "
        "full batch's 1.0000." in text
    )
    # The length-order caveat only where microbatches are sorted by length.
    assert "Length-sorted" not in text and "--skew" not in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["--skew", "2"], "--skew must be between 0 and 1, got 2.0"),
        (["--batch-size", "10", "--microbatches", "4"], "must be divisible"),
        (["--steps", "many"], "invalid int value"),
        (["--out", "TMP/file"], "--out must be a directory"),
        # Said before the training, not when the results are written after it.
        (["--out", "TMP/file/sub"], "cannot be created: "),
        (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
        # A larger seed would initialise the model as its low 32 bits do.
        (["--seed", str(2**32)], "--seed must be in [0, 2**32), got 4294967296"),
    ],
)
def test_bad_flags_exit_with_a_message(argv, message, capsys, tmp_path):
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    (tmp_path / "file").write_text("", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m masked_multistep.demo: ")


def test_an_undefined_noise_scale_is_said_and_written_as_null(tmp_path):
    # Windows of one microbatch have no noise scale (K < 2): the table says why
    # instead of "nan tokens", and summary.json holds null (JSON has no NaN).
    from masked_multistep.demo import report

    run = {
        "grad_rel_error_mean": 0.0,
        "grad_rel_error_max": 0.0,
        "final_train_loss": 1.0,
        "heldout_loss": 1.0,
        "train_loss": [1.0],
        "grad_rel_error": [0.0],
        "smoothed_noise_scale": [float("nan")],
        "final_smoothed_noise_scale": float("nan"),
    }
    summary = {
        "config": {
            "steps": 1,
            "batch_size": 4,
            "microbatches": 1,
            "skew": 1.0,
            "seed": 0,
        },
        "tokens_per_microbatch_first_batch": [7],
        "mean_tokens_per_batch": 7.0,
        "runs": {name: dict(run) for name in report.RUNS},
    }
    text = " ".join(report.format_table(summary).split())
    assert "undefined at the last step: it needs 2 or more microbatches" in text
    assert "nan" not in text and "Length-sorted" not in text
    report.write(summary, str(tmp_path))

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    written = json.loads(
        (tmp_path / "summary.json").read_text(encoding="utf-8"), parse_constant=refuse
    )
    masked = written["runs"]["masked_multisteps"]
    assert (
        masked["smoothed_noise_scale"] == [None]
        and masked["final_smoothed_noise_scale"] is None
    )


def test_skew_controls_length_order():
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=64)
    sorted_order = arrange(np.random.default_rng(1), lengths, 1.0)
    assert np.all(np.diff(lengths[sorted_order]) >= 0)
    # At skew 0 the layout is a random permutation, unrelated to the lengths.
    random_order = arrange(np.random.default_rng(1), lengths, 0.0)
    assert sorted(random_order) == list(range(64))
    assert abs(np.corrcoef(np.arange(64), lengths[random_order])[0, 1]) < 0.5

    corpus = make_corpus(np.random.default_rng(0))
    b = make_batches(
        np.random.default_rng(0), corpus, num_batches=2, batch_size=16, skew=1.0
    )
    assert b.inputs.shape == b.targets.shape == b.mask.shape == (2, 16, 64)
    counts = b.mask.sum(axis=-1)
    assert np.all(np.diff(counts, axis=-1) >= 0)
    # The mask covers exactly the real next tokens; padding is never a target.
    assert np.all((b.targets != 0) == b.mask)
    assert np.all(
        b.inputs[:, :, 1:][b.mask[:, :, :-1]] == b.targets[:, :, :-1][b.mask[:, :, :-1]]
    )


def test_demo_requirements_are_the_demo_extra():
    import configparser
    import pathlib
    import re

    from masked_multistep.demo import cli

    cfg = configparser.ConfigParser()
    cfg.read(
        pathlib.Path(__file__).resolve().parent.parent / "setup.cfg", encoding="utf-8"
    )
    extra = cfg["options.extras_require"]["demo"].split()
    assert {re.split(r"[<>=!~\[]", r)[0] for r in extra} == set(cli.REQUIREMENTS)


@pytest.mark.parametrize("module", ["flax", "matplotlib", "tqdm"])
def test_missing_requirement_says_what_to_install(
    module, monkeypatch, capsys, tmp_path
):
    import sys

    # `None` in sys.modules makes `import module` raise ModuleNotFoundError.
    monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "out"
    assert main(["--steps", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"missing: {module}." in err
    assert "`make demo`" in err and '`pip install -e ".[demo]"`' in err
    assert not out.exists()  # stopped before training


# A meta-path finder that makes one top-level package look uninstalled: its
# import raises ModuleNotFoundError, as it does in an environment without it.
_BLOCKER = """
import importlib.abc, importlib.machinery, runpy, sys

blocked = sys.argv.pop(1)

class Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):
        pass

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == blocked:
            return importlib.machinery.ModuleSpec(name, Missing())
        return None

sys.modules.pop(blocked, None)
sys.meta_path.insert(0, Block())
runpy.run_module("masked_multistep.demo", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_python_m_demo_without_tqdm_names_the_extra(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER, "tqdm", "--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "needs the `demo` extra (flax, matplotlib, tqdm); missing: tqdm." in (
        proc.stderr
    )
    assert '`pip install -e ".[demo]"`' in proc.stderr and "`make demo`" in proc.stderr
    assert not out.exists()


def _run_result(train, grad_rel_error, train_loss, noise_scale=None):
    return train.RunResult(
        train_loss=np.asarray(train_loss, np.float64),
        grad_rel_error=np.asarray(grad_rel_error, np.float64),
        heldout_loss=1.5,
        noise_scale=None if noise_scale is None else np.asarray(noise_scale),
    )


def test_summary_takes_mean_and_max_over_steps_and_the_loss_of_the_last_10():
    from masked_multistep.demo import report, train

    steps = 12
    config = train.Config(steps=steps)
    errors = np.linspace(0.1, 1.2, steps)  # mean 0.65, max 1.2
    losses = np.arange(steps, dtype=np.float64)  # the last 10: 2..11, mean 6.5
    results = {
        name: _run_result(
            train,
            errors,
            losses,
            np.full(steps, 40.0) if name == "masked_multisteps" else None,
        )
        for name in report.RUNS
    }
    summary = report.summarize(config, results, np.array([1, 2, 3, 4]), 10.0)
    assert summary["final_train_loss_steps"] == 10
    for run in summary["runs"].values():
        assert run["grad_rel_error_mean"] == pytest.approx(0.65)
        assert run["grad_rel_error_max"] == pytest.approx(1.2)
        assert run["final_train_loss"] == pytest.approx(6.5)
    assert summary["runs"]["masked_multisteps"]["final_smoothed_noise_scale"] == 40.0


def test_the_table_prints_each_runs_mean_and_max_error_in_their_columns():
    from masked_multistep.demo import report

    summary = _summary(
        5,
        {
            "grad_rel_error_mean": 0.25,
            "grad_rel_error_max": 0.75,
            "final_train_loss": 1.0,
            "heldout_loss": 1.0,
            "final_smoothed_noise_scale": float("nan"),
        },
    )
    text = report.format_table(summary)
    row = next(s for s in text.splitlines() if s.startswith("optax.MultiSteps"))
    assert row.split()[1:3] == ["2.50e-01", "7.50e-01"]
    # Windows of 2 microbatches can estimate the noise scale: an undefined one
    # is put down to the gradient not being resolved, not to the window size.
    flat = " ".join(text.split())
    assert "undefined at the last step: the windows did not resolve" in flat
    assert "needs 2 or more microbatches" not in flat


def test_relative_error_is_the_distance_over_the_references_norm():
    from masked_multistep.demo.train import relative_error

    g_ref = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}
    g = {"a": np.array([3.0, 2.0], np.float32), "b": np.array([[4.0]], np.float32)}
    # ‖g − g_ref‖ = 2, ‖g_ref‖ = 5 (not ‖g‖ = √29, nor the squared ratio 0.16).
    assert relative_error(g, g_ref) == pytest.approx(0.4)
    assert relative_error(g_ref, g_ref) == 0.0


def test_every_flag_reaches_the_training(monkeypatch, tmp_path):
    from masked_multistep.demo import train

    seen = []

    class Stop(Exception):
        pass

    def stop(config, progress=range):
        seen.append(config)
        raise Stop  # before any training

    monkeypatch.setattr(train, "train_all", stop)
    argv = ["--steps", "2", "--microbatches", "3", "--batch-size", "9"]
    argv += ["--skew", "0.25", "--seed", "7", "--out", str(tmp_path / "out")]
    with pytest.raises(Stop):
        main(argv)
    assert seen == [
        train.Config(steps=2, microbatches=3, batch_size=9, skew=0.25, seed=7)
    ]


def test_intermediate_skew_is_partly_sorted():
    # --skew 0.5 lies between the two layouts: the microbatches' lengths rise
    # on the whole, but the batch is not sorted.
    lengths = np.random.default_rng(0).permutation(64)
    order = arrange(np.random.default_rng(1), lengths, 0.5)
    assert sorted(order) == list(range(64))
    assert not np.all(np.diff(lengths[order]) >= 0)
    assert 0.5 < np.corrcoef(np.arange(64), lengths[order])[0, 1] < 0.99


def test_sequence_lengths_cover_each_topics_whole_range():
    from masked_multistep.demo.data import PAD, sample_sequences

    corpus = make_corpus(np.random.default_rng(0), seq_len=12)
    tokens, lengths = sample_sequences(np.random.default_rng(1), corpus, 4000)
    assert tokens.shape == (4000, 13)
    np.testing.assert_array_equal((tokens != PAD).sum(axis=-1), lengths)
    seen = {(int(t), int(n)) for t, n in zip(tokens[:, 0], lengths, strict=True)}
    for marker, (low, high) in zip(corpus.markers, corpus.length_ranges, strict=True):
        topic = sorted(n for t, n in seen if t == marker)
        # Inclusive at both ends: the long topics fill all seq_len + 1 tokens.
        assert topic == list(range(low, high + 1)), (marker, topic)


@pytest.mark.parametrize("encoding", ["cp1252", "latin-1", "ascii"])
def test_the_table_prints_on_a_stream_that_is_not_utf8(encoding, monkeypatch, tmp_path):
    # A Windows console redirected to a file writes cp1252, a Latin-1 locale's
    # terminal Latin-1: neither has the legend's ‖ or −. The demo used to raise
    # UnicodeEncodeError there after the whole training, before writing its
    # files. Now its symbols are spelled in ASCII, and the files come first.
    from masked_multistep.demo import cli, report, train

    config = train.Config(steps=2, microbatches=2, batch_size=4)

    def train_all(config, progress=range):
        noise = {"masked_multisteps": [40.0, 50.0]}
        return {
            name: _run_result(train, [0.5, 0.25], [2.0, 1.0], noise.get(name))
            for name in report.RUNS
        }

    monkeypatch.setattr(train, "train_all", train_all)
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding=encoding)
    monkeypatch.setattr("sys.stdout", stdout)
    out = tmp_path / "out"
    argv = ["--steps", "2", "--microbatches", "2", "--batch-size", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    stdout.flush()
    printed = " ".join(raw.getvalue().decode(encoding).split())
    assert "grad rel. error: |g - g_full| / |g_full|, mean and max" in printed
    # (The path as the stream writes it: a user's name in it may not be ASCII.)
    assert cli.printable(f"wrote {out / 'summary.json'}", stdout) in printed
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["config"]["steps"] == config.steps
    # Where the stream can write them, the symbols stay.
    assert cli.printable("‖g − g_full‖", io.StringIO()) == "‖g − g_full‖"

    # The files are written before anything is printed: a stream that fails
    # (a closed pipe) loses the table, not the results.
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    again = tmp_path / "again"
    with pytest.raises(BrokenPipeError):
        main([*argv, "--out", str(again)])
    assert {p.name for p in again.iterdir()} == {"summary.json", "curves.png"}
