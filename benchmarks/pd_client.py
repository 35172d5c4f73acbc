"""What ``benchmarks/bench_pd.py`` talks to its processes with: ``Client`` (one keep-alive HTTP/1.1
connection over a raw socket, so the client's own cost stays small beside the latencies
measured) and ``get`` (a plain GET). Its children are ``benchmarks/children.py``'s."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request


class Client:
    """One keep-alive HTTP/1.1 connection over a raw socket; answers with a Content-Length or
    chunked (the router streams SSE chunked). ``post``: status, head, body, seconds from the
    request write to the answer's last byte."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = f"{host}:{port}".encode()

    def close(self) -> None:
        self.sock.close()

    def post(self, path: str, body: bytes) -> tuple[int, bytes, bytes, float]:
        req = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % (
            path.encode(),
            self.host,
        )
        req += b"Content-Length: %d\r\n\r\n" % len(body) + body
        t0 = time.perf_counter()
        self.sock.sendall(req)
        buf, end, n, chunked = b"", -1, 0, False
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
            if end < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    continue
                lower = buf[:end].lower()
                i = lower.find(b"content-length:")
                chunked = i < 0
                if not chunked:
                    n = int(lower[i + 15 :].split(b"\r\n", 1)[0])
            if chunked and buf.endswith(b"0\r\n\r\n") and _chunked_done(buf, end + 4):
                break
            if not chunked and len(buf) >= end + 4 + n:
                break
        elapsed = time.perf_counter() - t0
        head, rest = buf[:end], buf[end + 4 :]
        return int(buf[9:12]), head, _dechunk(rest) if chunked else rest[:n], elapsed


def _chunked_done(buf: bytes, i: int) -> bool:
    while True:
        j = buf.find(b"\r\n", i)
        if j < 0:
            return False
        size = int(buf[i:j].split(b";")[0], 16)
        if size == 0:
            return True
        i = j + 2 + size + 2
        if i > len(buf):
            return False


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    i = 0
    while True:
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2


def get(url: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + path, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
