"""An HTTP server on 127.0.0.1 that answers as vLLM's completions endpoint does, from a model folder in float64
(`tests.teacher.test_served.answer_from`): for the tests whose served teacher is reached from other processes
(Ray actors), where patching `ServedTeacher._call` in the test process would not reach. It checks the wiring of
the engines and stores around a served teacher; the server itself is a stand-in, not a real inference server."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@contextmanager
def serving(model_dir: Path):
    """Yields (URL, counter) of a server that answers `GET /v1/models` and `POST /v1/completions` for `model_dir`;
    `counter["completions"]` counts the completions it answered."""
    from tests.teacher.test_served import answer_from

    answer = answer_from(model_dir)
    counter = {"completions": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._reply(answer(None, "GET", self.path))

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                counter["completions"] += 1
            self._reply(answer(None, "POST", self.path, body))

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counter
    finally:
        server.shutdown()
        server.server_close()
