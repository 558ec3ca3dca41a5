"""The loop around the step: several steps per call, batches made ahead, and what stays equal."""

import threading
import time

import pytest
from helpers import (
    TraceCountingTrainer,
    assert_trees_bytes_equal,
    event_series,
    plain_orbax_state,
    tiny_config,
)

import mptrain
from mptrain.train import loop

LOG4 = {"log_every_steps": 4}  # intervals that 4 steps per call divide


@pytest.fixture(scope="module")
def single_steps(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single")
    mptrain.run(tiny_config(**LOG4), workdir)
    return workdir


def test_four_steps_per_call_are_four_single_steps_to_the_byte(single_steps, tmp_path):
    trainer = TraceCountingTrainer(tiny_config(steps_per_call=4, **LOG4), tmp_path)
    trainer.train_and_evaluate()
    assert trainer.train_step_traces == 1  # one program: the scan of four steps
    for step in (4, 8):
        assert_trees_bytes_equal(
            plain_orbax_state(single_steps, step), plain_orbax_state(tmp_path, step)
        )
    for tag in ("loss", "grad_norm", "eval_loss"):
        assert event_series(tmp_path, tag) == event_series(single_steps, tag), tag


@pytest.mark.slow  # a variant: make test keeps four steps a call equal to four single steps
def test_four_steps_per_call_resume_to_the_same_bytes(single_steps, tmp_path):
    mptrain.run(tiny_config(steps_per_call=4, num_train_steps=4, **LOG4), tmp_path)
    mptrain.run(tiny_config(steps_per_call=4, **LOG4), tmp_path)  # resumes at step 4
    assert_trees_bytes_equal(plain_orbax_state(single_steps, 8), plain_orbax_state(tmp_path, 8))


def test_prefetching_changes_no_result(single_steps, tmp_path):
    assert loop.prefetch_depth(None, "cpu") == 0  # a CPU's default: the single-step run made none
    mptrain.run(tiny_config(**LOG4, **{"data.prefetch": 3}), tmp_path)
    assert_trees_bytes_equal(plain_orbax_state(single_steps, 8), plain_orbax_state(tmp_path, 8))


def test_intervals_that_a_call_does_not_divide_are_config_errors(tmp_path):
    with pytest.raises(mptrain.config.ConfigError, match="steps_per_call=4: log_every_steps=2"):
        mptrain.run(tiny_config(steps_per_call=4), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    mptrain.run(tiny_config(num_train_steps=6, **{"checkpoint_every_steps": 2}), tmp_path / "b")
    config = tiny_config(steps_per_call=4, **LOG4)  # the checkpoint is at 6: not a boundary
    with pytest.raises(mptrain.config.ConfigError, match="resumes at step 6"):
        mptrain.run(config, tmp_path / "b")


def test_runs_that_differ_in_their_log_interval_or_length_share_one_step_program(tmp_path):
    """`log_every_steps` and `num_train_steps` are values the step reads (`LogTotals`), not
    constants of its program: the suite's tiny runs, and a resume that trains longer, compile
    one step where each pair of them compiled its own."""
    from mptrain.plan import step  # the run's step traced on abstract shapes, as a plan does

    programs = [
        step._trace(mptrain.Trainer(tiny_config(**keys), tmp_path))[0].lower().as_text()
        for keys in ({}, LOG4, {"num_train_steps": 100})
    ]
    assert programs[0] == programs[1] == programs[2]


def test_the_prefetcher_keeps_order_and_hands_on_errors():
    made = []

    def fetch(i):
        made.append(i)
        if i == 6:
            raise OSError("disk gone")
        return i * 10

    with loop.Prefetcher(fetch, range(0, 4), depth=2) as batches:
        assert list(batches) == [0, 10, 20, 30]
    with loop.Prefetcher(fetch, range(4, 8), depth=2) as batches:
        it = iter(batches)
        assert [next(it), next(it)] == [40, 50]
        with pytest.raises(OSError, match="disk gone"):
            next(it)
    assert list(loop.Prefetcher(lambda i: -i, range(3), depth=0)) == [0, -1, -2]


def test_the_prefetcher_works_ahead_and_stops_when_closed():
    started = threading.Event()

    def fetch(i):
        started.set()
        return i

    batches = loop.Prefetcher(fetch, range(1000), depth=3)
    it = iter(batches)
    assert next(it) == 0
    deadline = time.monotonic() + 5
    while batches._queue.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batches._queue.qsize() == 3  # made ahead, no further than `depth`
    batches.close()
    assert not batches._thread.is_alive()
