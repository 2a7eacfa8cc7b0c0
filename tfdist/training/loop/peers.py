"""The TensorFlow errors that mean a peer task went away, not a bug in this program.

Shared by every trainer that talks to other tasks (sync, ps, pipeline); the
failure kinds they become are named in ``training.loop.recovery``.
"""

import tensorflow as tf

# Errors that mean a peer went away rather than a bug in this program.
PEER_ERRORS = (
    tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)
