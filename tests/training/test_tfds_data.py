"""``models/tfds_data``: a missing dataset on a machine that cannot download it is one
line at once, not minutes of retries."""

import socket
import threading
import time

import pytest

from tfdist.models import tfds_data
from tfdist.protocol import ConfigError


class _Unprepared:
    version = "3.0.1"

    def __init__(self):
        self.downloads = 0

    def is_prepared(self):
        return False

    def download_and_prepare(self):
        self.downloads += 1
        raise OSError("the download ran")


@pytest.fixture
def unprepared(monkeypatch):
    import tensorflow_datasets as tfds

    builder = _Unprepared()
    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: builder)
    for name in tfds_data.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return builder


def _offline(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


def test_offline_the_default_directory_fails_at_once_without_downloading(monkeypatch, unprepared):
    monkeypatch.setattr(socket, "create_connection", _offline)
    began = time.monotonic()
    with pytest.raises(ConfigError) as err:
        tfds_data.ensure_available("mnist", None)
    assert unprepared.downloads == 0
    assert time.monotonic() - began < 5  # what the check replaces took minutes
    text = str(err.value)
    assert "storage.googleapis.com cannot be reached (Name or service not known)" in text
    assert "TFDS_DATA_DIR" in text and "mnist/3.0.1" in text and "\n" not in text


def test_online_or_behind_a_proxy_the_download_runs(monkeypatch, unprepared):
    class _Open:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: _Open())
    with pytest.raises(ConfigError, match="the download ran"):
        tfds_data.ensure_available("mnist", None)
    assert unprepared.downloads == 1
    # A proxy: a direct connection says nothing about whether a download would work.
    monkeypatch.setattr(socket, "create_connection", _offline)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    with pytest.raises(ConfigError, match="the download ran"):
        tfds_data.ensure_available("mnist", None)
    assert unprepared.downloads == 2


def test_a_name_lookup_that_never_answers_is_bounded_by_the_timeout(monkeypatch, unprepared):
    release = threading.Event()

    def hangs(*args, **kwargs):
        release.wait(30)  # a resolver that does not answer
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "create_connection", hangs)
    try:
        why = tfds_data.unreachable(timeout=0.2)
    finally:
        release.set()
    assert why == ("storage.googleapis.com cannot be reached (no answer within 0.2 s, "
                   "name lookup included)")
