"""The page's PCM stream route (`GET /pcm/{run_id}`) on a real server: a reader is answered once its
run starts, within a grace period (the page asks a moment before its run starts); an id that no run
takes gets 404, and a client has a bounded number of streams open (429 over it)."""
import contextlib
import threading

import httpx
import pytest
from conftest import read_pcm, serving
from starlette.applications import Starlette

from ui.pcm_stream import PcmChannels

GRACE_S = 1.0
PER_CLIENT = 2


@pytest.fixture
def pcm():
    """(channels, their route's server URL)."""
    channels = PcmChannels(grace_s=GRACE_S, per_client=PER_CLIENT)
    with serving(Starlette(routes=[channels.route()])) as url:
        yield channels, f"{url}/"


def reader_waits(channels: PcmChannels, run_id: str) -> None:
    """Hang guard only: the reader's request reaches the server within a moment."""
    done = threading.Event()
    while not done.wait(0.02):
        with channels._lock:
            channel = channels._channels.get(run_id)
            if channel is not None and channel.reader_attached:
                return


def test_an_id_no_run_takes_is_404(pcm):
    _, url = pcm
    response = httpx.get(f"{url}pcm/nobody-runs-this-1234", timeout=60)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == ("No run 'nobody-runs-this-1234' has started here (a page opens its run's stream at the "
                                                   f"click, and the run starts within {GRACE_S:g} s).")


def test_a_reader_that_comes_just_before_its_run_hears_it(pcm):
    channels, url = pcm
    frames, opened = [], threading.Event()
    reader = threading.Thread(target=read_pcm, args=(url, "custom-race-0001", frames, opened))
    reader.start()
    assert opened.wait(60)
    reader_waits(channels, "custom-race-0001")
    channels.open("custom-race-0001")  # the run's handler starts
    channels.send("custom-race-0001", b"\x01\x00\x02\x00")
    channels.finish("custom-race-0001")
    reader.join(60)
    assert [frame for _, frame in frames if frame] == [b"\x01\x00\x02\x00"]


def test_a_client_has_a_bounded_number_of_streams_open(pcm):
    channels, url = pcm
    runs = [f"custom-cap-{n:04d}" for n in range(PER_CLIENT + 1)]
    for run in runs:
        channels.open(run)
    with httpx.Client(base_url=url, timeout=60) as client, contextlib.ExitStack() as streams:
        readers = [streams.enter_context(client.stream("GET", f"pcm/{run}")) for run in runs[:PER_CLIENT]]
        assert [reader.status_code for reader in readers] == [200] * PER_CLIENT
        refused = client.get(f"pcm/{runs[-1]}")
        assert refused.status_code == 429
        assert refused.json()["error"]["message"] == f"{PER_CLIENT} audio streams of this client are already open; close one (or stop its run) first."
        channels.finish(runs[0])  # one run ends: its stream ends, and its place is free again
        readers[0].read()
        with client.stream("GET", f"pcm/{runs[-1]}") as late:
            assert late.status_code == 200
            channels.finish(runs[-1])
