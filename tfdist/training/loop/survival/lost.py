"""The TensorFlow errors that mean another member went away (was lost), not a bug in this program.

Shared by every trainer that talks to other members (sync, ps, pipeline); the
failure kinds they become are named in ``training.loop.survival.recovery``.
"""

import tensorflow as tf

LOST_MEMBER_ERRORS = (
    tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)
