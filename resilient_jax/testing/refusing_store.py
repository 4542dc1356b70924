"""An HTTP proxy in front of a GCS emulator that refuses the uploads of chosen checkpoint steps.

An object store can refuse a write for reasons of its own (permissions changed, a retention policy,
a quota): HTTP 403 on the upload, with everything else served as usual. Point the clients at
`url` (`environ()`, like `GcsEmulator.environ()`) instead of the emulator, and set `refuse_steps`:
every upload of an object under a step directory of those steps (`<step>/...`, or Orbax's
temporary `<step>.orbax-checkpoint-tmp-*/...`) is answered 403 without reaching the emulator, and
counted in `refused`; a step in `refuse_once` has its first upload refused only (a refusal that
passes: the save fails, a save of the step again can commit). The uploads of a step in `delay_s`
are held that many seconds each before they are forwarded (a slow commit). Everything else is
forwarded as it is.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import time
import urllib.parse

# Headers that belong to one hop, not to the request or answer passed on.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
_UPLOAD_PREFIX = "/upload/storage/"
# Bounds what the proxy reads of a request's body to find an object's name (a multipart upload
# names it in the JSON part at the start); the whole body is forwarded regardless.
_NAME_SEARCH_BYTES = 4096


class RefusingStore:
    """Forwards to `upstream` ("http://host:port"); refuses uploads of `refuse_steps`."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.refuse_steps: set[int] = set()
        self.refuse_once: set[int] = set()
        self.delay_s: dict[int, float] = {}
        self.refused: list[str] = []  # the names of the objects refused, in order
        self._lock = threading.Lock()
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect

            def do_GET(self) -> None:
                store._forward(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

            def log_message(self, *args: object) -> None:
                pass  # quiet: tests read events, not an access log

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="refusing-store", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def environ(self) -> dict[str, str]:
        """The endpoint variables of `GcsEmulator.environ()`, sent here instead."""
        return {"TENSORSTORE_GCS_HTTP_URL": self.url, "STORAGE_EMULATOR_HOST": self.url}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def _refuses(self, name: str) -> bool:
        """Whether to refuse an upload of `name` (recorded in `refused` if so)."""
        with self._lock:
            for step in self.refuse_steps | self.refuse_once:
                if _in_step(name, step):
                    self.refuse_once.discard(step)
                    self.refused.append(name)
                    return True
        return False

    def _delay_s(self, name: str) -> float:
        with self._lock:
            return max((s for step, s in self.delay_s.items() if _in_step(name, step)), default=0)

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        if handler.path.startswith(_UPLOAD_PREFIX):
            name = _object_name(handler.path, body)
            if name is not None and self._refuses(name):
                _answer(handler, 403, b'{"error": {"code": 403, "message": "refused by test"}}')
                return
            if name is not None:
                time.sleep(self._delay_s(name))
        headers = {
            k: v
            for k, v in handler.headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() != "host"
        }
        upstream = http.client.HTTPConnection(*self._upstream, timeout=60)
        try:
            upstream.request(handler.command, handler.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            answer_headers = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in _HOP_HEADERS and k.lower() != "content-length"
            ]
            _answer(handler, response.status, data, answer_headers, head=handler.command == "HEAD")
        except OSError:
            _answer(handler, 502, b"")
        finally:
            upstream.close()


def _in_step(name: str, step: int) -> bool:
    """Whether the object `name` is part of checkpoint step `step` (its directory, or Orbax's
    temporary one for it)."""
    return re.search(rf"(^|/){step}(\.orbax-checkpoint-tmp[^/]*)?/", name) is not None


def _object_name(path: str, body: bytes) -> str | None:
    """The object an upload writes: its `name` query parameter, or the JSON metadata part at the
    start of a multipart body."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    if "name" in query:
        return query["name"][0]
    match = re.search(rb'\{[^{}]*"name"\s*:\s*"([^"]+)"', body[:_NAME_SEARCH_BYTES])
    if match is None:
        return None
    try:
        return str(json.loads(b'"' + match.group(1) + b'"'))
    except ValueError:
        return None


def _answer(
    handler: http.server.BaseHTTPRequestHandler,
    status: int,
    data: bytes,
    headers: list[tuple[str, str]] | None = None,
    head: bool = False,
) -> None:
    try:
        handler.send_response(status)
        for key, value in headers or [("Content-Type", "application/json")]:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if not head:
            handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True  # the client gave up on the request (a save it failed)
