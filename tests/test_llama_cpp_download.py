"""The oracle's download survives a broken connection (tests/llama_cpp_scripts.py, run by `make install`).

A CI run lost its landing when pip's download of the 77 MB sdist broke at 64.5 MB six times in a row; the fallback
reads the file in ranges, each retried. Here a real HTTP server on loopback serves a payload with Range support and
breaks the first answer to every range (a short body under the full Content-Length), as that connection did.
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import llama_cpp_scripts as scripts
import pytest

PAYLOAD = os.urandom(100_000)


def _server(honour_range: bool = True):
    seen: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()

        def do_GET(self):
            wanted = self.headers.get("Range", "")
            seen[wanted] = seen.get(wanted, 0) + 1
            if not honour_range:
                body = PAYLOAD
                self.send_response(200)
            else:
                first, last = map(int, wanted.removeprefix("bytes=").split("-"))
                body = PAYLOAD[first:last + 1]
                self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body if seen[wanted] > 1 else body[: len(body) // 2])  # the first answer breaks
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/sdist.tar.gz", seen


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(scripts, "CHUNK", 16_384)
    monkeypatch.setattr(scripts.time, "sleep", lambda seconds: None)


def test_a_download_broken_in_every_range_arrives_whole(tmp_path, quick):
    server, url, seen = _server()
    try:
        scripts.ranged_download(url, tmp_path / "sdist.tar.gz")
    finally:
        server.shutdown()
    assert (tmp_path / "sdist.tar.gz").read_bytes() == PAYLOAD
    assert len(seen) == 7 and set(seen.values()) == {2}  # 7 ranges of 16 KiB, each broken once, then read whole


def test_a_server_that_ignores_ranges_is_refused_after_the_retries(tmp_path, quick):
    server, url, _ = _server(honour_range=False)
    try:
        with pytest.raises(SystemExit, match=f"failed {scripts.TRIES} times"):
            scripts.ranged_download(url, tmp_path / "sdist.tar.gz")
    finally:
        server.shutdown()
