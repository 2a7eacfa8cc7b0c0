"""Fetching a finished step's results on the chief: riding out the loss of the worker
that ran it, and a few transient RPC errors (then ``RpcFailed``: one line, exit 75)."""

from __future__ import annotations

import time

from tfdist.training.loop.survival.recovery import RpcFailed, is_worker_failure, telling_line

# An error on the chief's schedule/fetch path that TensorFlow does not take
# for a lost worker, but that a retry may cure: gRPC INTERNAL (status 13,
# e.g. "Unable to parse request" while copying a finished closure's outputs)
# and UNKNOWN. Retried TRANSIENT_RETRIES times, waiting TRANSIENT_BACKOFF s,
# then twice that, ...; then the chief ends with one line and exit 75.
TRANSIENT_RETRIES = 3
TRANSIENT_BACKOFF = 0.5


def is_transient(err: BaseException) -> bool:
    import tensorflow as tf

    return isinstance(err, (tf.errors.InternalError, tf.errors.UnknownError))


def fetch(remote, deadline: float, retry_every: float = 0.2, *, member: str = "chief",
          retries: int = TRANSIENT_RETRIES, backoff: float = TRANSIENT_BACKOFF,
          sleep=time.sleep, log=None, worker_failure=None, transient=None):
    """``remote.fetch()``, riding out the loss of the worker that ran it, and
    a few transient RPC errors.

    The coordinator puts a lost worker's closure back on the queue and runs it
    elsewhere, but ``RemoteValue.fetch`` can still raise: the closure may have
    finished, and the copy of its outputs from the dead worker fails. The
    rerun sets fresh outputs on the same RemoteValue, so fetching again works.

    Any other error that ``transient`` accepts (``is_transient``) is retried
    ``retries`` times with a doubling ``backoff``, each retry logged in one
    line: a failed copy of the outputs is tried afresh (``RemoteValue.get``
    copies again until one copy succeeds). Past that, ``RpcFailed``: one line,
    exit 75, never a traceback. ``worker_failure``/``transient``/``sleep``/
    ``log`` are for tests.
    """
    worker_failure = worker_failure or is_worker_failure
    transient = transient or is_transient
    log = log or (lambda line: print(line, flush=True))
    failures = 0
    while True:
        try:
            return remote.fetch()
        except Exception as err:  # pylint: disable=broad-except
            if worker_failure(err):
                if time.monotonic() > deadline:
                    raise
                sleep(retry_every)
                continue
            if not transient(err):
                raise
            failures += 1
            what = f"{type(err).__name__}: {telling_line(err)}"
            if failures > retries:
                raise RpcFailed(
                    f"{member}: fetching a finished step's results failed {failures} times "
                    f"({what}), not a lost worker; relaunch the same command to resume "
                    "from the newest checkpoint") from None
            wait = backoff * 2 ** (failures - 1)
            log(f"warning: {member}: fetching a step's results failed ({what}); "
                f"retry {failures} of {retries} in {wait:g}s")
            sleep(wait)
