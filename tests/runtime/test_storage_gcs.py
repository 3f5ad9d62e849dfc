"""`gs://` paths: gcsfs (the `[gcs]` extra) is the file system, and the failures are one `error:` line.

No GCS emulator is on PyPI and nothing here reaches Google, so the server is a plain HTTP server of the
standard library on 127.0.0.1, given to gcsfs as `endpoint_url` in `--storage-options`, that answers
every request the way GCS's JSON API answers a bucket these credentials may not read (403) or a
bucket that does not exist (404). It records each request, to show that gcsfs made it (GCS's JSON API
paths) with the token given in the options; the error line must not show the token. gcsfs's default
file system first asks GCS's storage-control gRPC API for the bucket's layout, which a plain HTTP
server cannot answer (it waits 60 s): the commands run with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false,
as with any emulator. Reads and writes of real objects over gs:// are not tested here (docs/SCALE.md).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.runtime.test_storage_stages import cli, one_error_line
from tests.s3_cases import SECRET

pytestmark = pytest.mark.slow
pytest.importorskip("gcsfs")


class _GcsAnswers(BaseHTTPRequestHandler):
    """403 for the bucket `denied`, 404 for any other, as GCS's JSON API words them."""

    seen: list[tuple[str, str]] = []  # (path, Authorization header) of each request

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append((self.path, self.headers.get("Authorization", "")))
        denied = "/b/denied" in self.path
        code, message = (403, "caller does not have storage.objects.get access") if denied else (
            404, "The specified bucket does not exist.")
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def gcs_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GcsAnswers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_gs_url_is_gcsfs_and_its_failures_are_one_line(gcs_endpoint, tmp_path):
    options = json.dumps({"endpoint_url": gcs_endpoint, "token": SECRET})
    env = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "FETCH_RAW_TOKEN_EXPIRY": "false"}  # nothing asks Google
    missing = one_error_line(cli(["status", "gs://missing/aligned", "--storage-options", options], tmp_path, env),
                             "gs://missing/aligned")
    assert "bucket 'missing' does not exist" in missing
    denied = one_error_line(cli(["inspect", "gs://denied/aligned", "--storage-options", options], tmp_path, env),
                            "gs://denied/aligned")
    assert "access was denied" in denied and "GOOGLE_APPLICATION_CREDENTIALS" in denied
    paths = {path.split("?")[0] for path, _ in _GcsAnswers.seen}
    assert {"/storage/v1/b/missing", "/storage/v1/b/denied/o/aligned"} <= paths  # gcsfs's requests, as GCS has them
    assert {token for _, token in _GcsAnswers.seen} == {f"Bearer {SECRET}"}  # the options' token, never printed
