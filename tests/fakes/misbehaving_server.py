"""A fake OpenAI-compatible server for fault injection only: faults a real vLLM cannot be made to show.

Started by the launcher in place of vLLM (MOE_EVAL_SERVER_MODULE=tests.fakes.misbehaving_server),
with the same argv. It becomes healthy and answers the launcher's warm-up completion correctly,
then misbehaves on every evaluation request as FAKE_SERVER_MODE says:
  hang       never answers (the request timeout must fire)
  error500   answers HTTP 500
  garbage    answers 200 with a body that is not JSON
  stubborn   never answers, and ignores SIGTERM (only SIGKILL ends it: a wedged server)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_SERVER_MODE", "hang")
_served = {"completions": 0}
_lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt: str, *args: object) -> None:
        print(f"fake-server: {fmt % args}", flush=True)

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._reply(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length) or b"{}")
        with _lock:
            _served["completions"] += 1
            first = _served["completions"] == 1
        if first:  # the launcher's warm-up: answer properly so that the run reaches the evaluation
            body = {
                "choices": [{"index": 0, "text": " 2", "finish_reason": "length"}],
                "model": request.get("model"),
            }
            self._reply(200, json.dumps(body).encode())
        elif MODE in ("hang", "stubborn"):
            print("fake-server: holding an evaluation request", flush=True)
            time.sleep(3600)
        elif MODE == "error500":
            self._reply(500, b'{"error": "injected fault"}')
        else:
            self._reply(200, b"<html>not json</html>", "text/html")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    if MODE == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"fake-server: mode {MODE} on {args.host}:{args.port}", flush=True)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
