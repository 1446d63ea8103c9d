"""A webhook receiver on loopback, as a user would run one behind CEILING_ALERT_WEBHOOK_URL:
it records every post (raw body and headers), answers 200, or 500 while told to fail, and
checks nothing itself, so tests check the signature and count duplicates from what it saw."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from infra.processes import free_port

# The largest post recorded: an event is a few hundred bytes.
POST_BYTES_MAX = 64 * 1024


@dataclass(frozen=True)
class Post:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int

    def json(self) -> Any:
        return json.loads(self.body)

    def signed_by(self, secret: str) -> bool:
        want = "sha256=" + hmac.new(secret.encode(), self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(self.headers.get("x-ceiling-signature", ""), want)


@dataclass
class AlertReceiver:
    port: int = field(default_factory=free_port)
    posts: list[Post] = field(default_factory=list)
    failures_left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/ceiling"

    def fail_next(self, n: int) -> None:
        with self._lock:
            self.failures_left = n

    def event_ids(self) -> list[str]:
        """The ids of the events it accepted (answered 200), in order, repeats included."""
        with self._lock:
            return [str(p.json()["event_id"]) for p in self.posts if p.status == 200]

    def start(self) -> AlertReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = min(int(self.headers.get("content-length") or 0), POST_BYTES_MAX)
                body = self.rfile.read(length)
                with receiver._lock:
                    failing = receiver.failures_left > 0
                    receiver.failures_left -= 1 if failing else 0
                    receiver.posts.append(Post(
                        self.path, {k.lower(): v for k, v in self.headers.items()}, body,
                        500 if failing else 200))
                self.send_response(500 if failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> AlertReceiver:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
