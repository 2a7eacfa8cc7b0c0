"""Reading a prepared tensorflow-datasets copy, with one clear line when it is not there.

Used by the built-in MNIST tasks; a user's task may use it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading

from tfdist.protocol import ConfigError

# What the error lines call a dataset, and the tfds version a copy must hold.
KNOWN = {"mnist": ("MNIST", "mnist/3.0.1")}
# Both splits are checked before training: the test split is otherwise read
# only after the whole run, and a damaged one would lose it.
SPLITS = ("train", "test")
# A TFRecord frames each record with a length, its CRC and the data's CRC.
_RECORD_FRAMING = 16
# Where tfds downloads MNIST from (and its own prepared copies): offline, a
# download retries against it for minutes before it gives up.
DOWNLOAD_HOST = ("storage.googleapis.com", 443)
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _names(name: str) -> tuple[str, str]:
    return KNOWN.get(name, (name, name))


# Decoded splits already read by this process, keyed by the files they came
# from (path, size, mtime): a notebook or a test calling fit again skips
# decoding 60,000 images (about 2 s of a short MNIST run), and a replaced or
# damaged file is read again, never served from memory.
_DECODED: dict = {}
_KEEP = 4  # MNIST's two splits are 55 MB together


def load(name: str, split: str, data_dir: str | None):
    """tfds dataset ``name``'s ``split`` as unbatched (features, label) pairs, or a clear error."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    title, version = _names(name)
    try:
        # Only eagerly: in a traced dataset_fn (the ps coordinator's) the
        # arrays would become constants copied into every worker's graph.
        key = _files_key(tfds, name, split, data_dir) if tf.executing_eagerly() else None
        if key is not None and key in _DECODED:
            return tf.data.Dataset.from_tensor_slices(_DECODED[key])
        source = tfds.load(name, split=split, data_dir=data_dir, as_supervised=True,
                           shuffle_files=False)
        if key is None:
            return source
        decoded = tf.nest.map_structure(
            lambda t: t.numpy(), source.batch(1 << 30).get_single_element())
        while len(_DECODED) >= _KEEP:  # bounded: the oldest goes first
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[key] = decoded
        return tf.data.Dataset.from_tensor_slices(decoded)
    except Exception as err:  # tfds raises many kinds when offline or missing
        where = data_dir or os.path.join("~", "tensorflow_datasets")
        raise ConfigError(
            f"{title} could not be loaded from {where!r} or downloaded ({_clip(_first(err))}); "
            f"point --data-dir (or TFDS_DATA_DIR) at a prepared tfds copy that holds {version}"
        ) from None


@contextlib.contextmanager
def _making_builder():
    """Around ``tfds.builder`` and its ``is_prepared``, which leave two things behind
    when the data are not prepared. The builder makes an empty temporary directory
    (``DatasetInfo.initialize_from_bucket``) and never removes it: temporary files go
    into one of ours, removed after. ``is_prepared`` logs absl warnings (``Variant
    folder … has no dataset_info.json``) ahead of the one line that says what is
    missing: those are held back."""
    absl = logging.getLogger("absl")
    scratch = tempfile.mkdtemp(prefix="tfdist-tfds-")
    saved, tempfile.tempdir = tempfile.tempdir, scratch
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)
        tempfile.tempdir = saved
        shutil.rmtree(scratch, ignore_errors=True)


def _files_key(tfds, name: str, split: str, data_dir: str | None):
    """What identifies a prepared split's bytes, or None when it is not prepared
    (then tfds.load itself says why)."""
    with _making_builder():
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    if not prepared:
        return None
    stats = []
    for path in builder.info.splits[split].filepaths:
        st = os.stat(str(path))
        stats.append((str(path), st.st_size, st.st_mtime_ns))
    return (name, split, tuple(stats))


def ensure_available(name: str, data_dir: str | None) -> None:
    """Make sure ``name`` is prepared (downloading it when online), or raise.

    Uses only the tfds builder, which starts no TensorFlow runtime, so it can
    run before the strategy is created.
    """
    import tensorflow_datasets as tfds

    title, version = _names(name)
    where = data_dir or os.path.join("~", "tensorflow_datasets")
    try:
        with _making_builder():
            builder = tfds.builder(name, data_dir=data_dir)
            prepared = builder.is_prepared()
        if not prepared:
            if data_dir is not None:
                # A directory the user chose should already hold the data;
                # downloading into it offline only retries for minutes.
                raise FileNotFoundError(f"no prepared {name}/{builder.version} there")
            offline = unreachable()
            if offline:
                raise FileNotFoundError(f"no prepared {name}/{builder.version} there, and "
                                        f"it cannot be downloaded: {offline}")
            builder.download_and_prepare()
    except Exception as err:  # offline download failures come in many types
        raise ConfigError(
            f"{title} could not be loaded from {where!r} ({_clip(_first(err))}); "
            f"point --data-dir (or TFDS_DATA_DIR) at a prepared tfds copy that holds {version}"
        ) from None
    for split in SPLITS:
        check_split(builder, split, title)


def unreachable(host: tuple[str, int] = DOWNLOAD_HOST, timeout: float = 5.0) -> str | None:
    """Why tfds's download host cannot be reached, or None when it can (or when a
    proxy, which a direct connection would not use, is set): a check of seconds
    where an offline download retries for minutes."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    answer: list = []

    def connect() -> None:
        try:
            with socket.create_connection(host, timeout=timeout):
                answer.append(None)
        except OSError as err:
            answer.append(f"{host[0]} cannot be reached ({err.strerror or err})")

    # The connection's timeout does not cover the name lookup, which a
    # resolver that does not answer can hold for half a minute: the whole
    # check waits ``timeout`` at most, and a lookup still running is left to
    # its daemon thread.
    attempt = threading.Thread(target=connect, name="tfds-reachable", daemon=True)
    attempt.start()
    attempt.join(timeout)
    if not answer:
        return f"{host[0]} cannot be reached (no answer within {timeout:g} s, name lookup included)"
    return answer[0]


def check_split(builder, split: str, title: str = "MNIST") -> None:
    """Raise ConfigError if ``split``'s files are truncated or corrupt.

    Sizes against tfds's metadata first (catches truncation at no cost), then
    every record's checksums and the record count, read without decoding:
    about 0.2 s for MNIST. TensorFlow's record reader is used directly, not
    a tf.data op, because an op would start the eager runtime, and
    MultiWorkerMirroredStrategy must configure it before it starts.
    """
    from tensorflow.python.lib.io import tf_record
    from tensorflow.python.util import deprecation

    info = builder.info.splits[split]
    paths = [str(p) for p in info.filepaths]
    where = os.path.dirname(paths[0]) if paths else str(builder.data_dir)
    fix = (f"prepare {title} again (delete that directory; tfds downloads it when online) or "
           "point --data-dir (or TFDS_DATA_DIR) at a good copy")
    try:
        size = sum(os.path.getsize(p) for p in paths)
    except OSError as err:
        raise ConfigError(f"{title}'s {split} split in {where!r} is incomplete "
                          f"({err.strerror}: {os.path.basename(err.filename or '')}); {fix}") from None
    expected = int(info.num_bytes) + _RECORD_FRAMING * info.num_examples
    if size != expected:
        raise ConfigError(
            f"{title}'s {split} split in {where!r} is damaged: its files hold {size} bytes, "
            f"tfds's metadata says {expected} (truncated or replaced); {fix}"
        )
    count = 0
    for path in paths:
        try:
            with deprecation.silence():  # tf.compat.v1's reader: the same C++ iterator, no runtime
                for _ in tf_record.tf_record_iterator(path):
                    count += 1
        except Exception as err:  # DataLossError for a bad checksum, OSError, ...
            raise ConfigError(
                f"{title}'s {split} split in {where!r} is damaged: {os.path.basename(path)}: "
                f"{_clip(_first(err))}; {fix}"
            ) from None
    if count != info.num_examples:
        raise ConfigError(
            f"{title}'s {split} split in {where!r} is damaged: {count} records, tfds's metadata "
            f"says {info.num_examples}; {fix}"
        )


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
