"""An S3 endpoint that runs out of room: a reverse proxy in front of moto's S3 server (which keeps objects in memory
and never fills) that, while the file FULL exists, answers every write (PUT, POST) with the 507 InsufficientStorage
that AWS S3 documents, and passes everything else through.

    python tests/service/full_s3.py UPSTREAM_URL PORT FULL_FILE
"""

from __future__ import annotations

import http.client
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REFUSAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InsufficientStorage</Code><Message>Insufficient '
           b"storage to perform the operation (planted by tests/service/full_s3.py)</Message>"
           b"<RequestId>full-s3</RequestId></Error>")
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: urllib.parse.SplitResult
    full_file: str

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def _forward(self) -> None:
        body = self._body()
        if self.command in ("PUT", "POST") and os.path.exists(self.full_file):
            self.send_response(507)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(REFUSAL)))
            self.end_headers()
            self.wfile.write(REFUSAL)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                     headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


def main() -> None:
    upstream, port, full_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    Proxy.upstream = urllib.parse.urlsplit(upstream)
    Proxy.full_file = full_file
    ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()


if __name__ == "__main__":
    main()
