"""Preemption under the synchronous strategies: TensorFlow's ``PreemptionCheckpointHandler``
(every worker saves at one agreed call, then ``Preempted``: exit 42), and its watcher
threads' deaths made one warning line."""

from __future__ import annotations

import os
import threading

from tfdist.training.loop.survival.recovery import Preempted, first_line

def preemption_handler(strategy, save, step_now):
    """A PreemptionCheckpointHandler that saves with ``save`` and raises Preempted.

    (None off the main thread, where no SIGTERM handler can be installed.)

    On SIGTERM to any worker, every worker saves at the same agreed call and
    then ``Preempted`` ends the run, so none is left waiting in a collective.
    TensorFlow restores its call counter from its own checkpoint manager; we
    give it an empty private directory so every worker counts from 0 in every
    run and they agree on the call number (ours restore from the chief's).
    """
    import tempfile

    import tensorflow as tf

    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be installed from the main thread
    quiet_watcher_deaths()
    counter_dir = tempfile.mkdtemp(prefix="preemption-")
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(), counter_dir, max_to_keep=1)

    def exit_fn():
        raise Preempted(step_now())

    config = tf.distribute.experimental.TerminationConfig(
        exit_fn=exit_fn, save_fn=save, grace_period=0,
    )
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        getattr(strategy, "cluster_resolver", None), manager, termination_config=config,
    )
    return _Handler(handler, counter_dir)


def _from_failure_handling(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("failure_handling",
                                                                "failure_handling.py")):
            return True
        tb = tb.tb_next
    return False


def quiet_watcher_deaths() -> None:
    """TensorFlow's preemption watcher threads die with a traceback when the
    coordination service's host is gone (a peer lost, or this task stopped
    and continued after its peers gave up on it); the task's own error line
    says what happened, so such a death is one warning line."""
    previous = threading.excepthook
    if getattr(previous, "quiet_watcher_deaths", False):
        return

    def hook(args):
        import tensorflow as tf

        if isinstance(args.exc_value, tf.errors.OpError) and _from_failure_handling(
                args.exc_traceback):
            print(f"warning: TensorFlow's preemption watcher stopped: "
                  f"{type(args.exc_value).__name__}: {first_line(args.exc_value)}", flush=True)
            return
        previous(args)

    hook.quiet_watcher_deaths = True
    threading.excepthook = hook


class _Handler:
    """``run`` without the deprecation warning TF's own save path triggers.

    (The handler reads its deprecated ``total_run_calls`` when it saves.)
    """

    def __init__(self, handler, counter_dir: str):
        self.handler, self.counter_dir = handler, counter_dir

    def run(self, fn, *args):
        from tensorflow.python.util import deprecation

        with deprecation.silence():
            return self.handler.run(fn, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the handler's watcher threads after a normal end of training.

        TF leaves that to ``__del__``, which never runs while the watcher
        thread holds the handler; the thread then dies with a traceback when
        the coordination service's host (the chief) exits first. Bounded, in
        case a peer is already gone.
        """
        def stop():
            try:
                self.handler._stop_cluster_wise_termination_watcher_thread()  # pylint: disable=protected-access
                self.handler._stop_poll_termination_signal_thread()  # pylint: disable=protected-access
            except Exception:  # pylint: disable=broad-except
                pass

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        stopper.join(timeout)
