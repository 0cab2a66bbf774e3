"""How a run's end becomes its record (siamesenorm/run/lifecycle.py train_to_the_end), in one process."""

import os
import signal

from siamesenorm.run.lifecycle import Terminated, raise_on_sigterm, train_to_the_end


def _end(fit, on_write=None):
    written = []

    def save_record(status, **extra):
        if on_write is not None:
            on_write(status)
        written.append((status, extra.get("error")))

    with raise_on_sigterm():
        try:
            code = train_to_the_end(fit, save_record, finished=lambda: True, convergence=dict,
                                    record_path="run.json", lead=True)
        except BaseException as err:  # noqa: BLE001  (what reaches the caller is part of the result)
            return written, err
    return written, code


def test_a_sigterm_during_training_is_a_stopped_record_and_reaches_the_caller():
    def fit():
        os.kill(os.getpid(), signal.SIGTERM)

    written, outcome = _end(fit)
    assert written == [("running", None), ("stopped", "Terminated: killed by SIGTERM")]
    assert isinstance(outcome, Terminated)


def test_a_second_sigterm_while_the_stopped_record_is_written_does_not_cut_it():
    """A launcher forwarding SIGTERM to a worker that also got one from its parent's death: the second one arrives
    while the worker writes its record; the record must still say stopped."""
    def fit():
        os.kill(os.getpid(), signal.SIGTERM)

    def on_write(status):
        if status == "stopped":
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, inside the write

    written, outcome = _end(fit, on_write)
    assert written[-1] == ("stopped", "Terminated: killed by SIGTERM")
    assert isinstance(outcome, Terminated) and str(outcome) == "killed by SIGTERM"


def test_a_finished_fit_is_a_finished_record():
    written, code = _end(lambda: None)
    assert code == 0 and [s for s, _ in written] == ["running", "finished"]

