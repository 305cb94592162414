"""Open a local HTML file in headless Chromium and report what happened, over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: no port, no websocket library, stdlib only).

What comes back: the value of a script evaluated in the page, every console error, uncaught
exception and log error (CSP violations are log errors), every URL the page asked the network
for, and optionally a PNG screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PageVisit:
    value: Any = None
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: bytes | None = None


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self.write_fd, data):]
        while True:
            reply = self.receive(timeout)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self.events.append(reply)

    def receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return dict(json.loads(raw))

    def wait_for(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self.receive(max(0.0, deadline - time.monotonic())))


def visit(chromium: str, page: Path, expression: str, *, screenshot: tuple[int, int] | None = None,
          timeout: float = 60.0) -> PageVisit:
    """Load ``page`` (a file) with the network off, evaluate ``expression`` once it has loaded."""
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    width, height = screenshot or (1280, 900)

    def fds() -> None:  # Chromium reads commands on fd 3 and writes replies to fd 4
        read_end, write_end = os.dup(to_chrome_r), os.dup(from_chrome_w)  # neither is 3 or 4 now
        os.dup2(read_end, 3)
        os.dup2(write_end, 4)

    with tempfile.TemporaryDirectory(prefix="smolvm-chromium-") as profile:
        proc = subprocess.Popen(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             # no network: every name fails to resolve and every proxied request goes nowhere
             "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--window-size={width},{height}", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        pipe = _Pipe(to_chrome_w, from_chrome_r)
        try:
            return _drive(pipe, page, expression, screenshot, timeout)
        finally:
            try:
                pipe.send("Browser.close", timeout=10)
            except (OSError, RuntimeError, TimeoutError, EOFError):
                pass
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(to_chrome_w)
            os.close(from_chrome_r)


def _drive(pipe: _Pipe, page: Path, expression: str, screenshot: tuple[int, int] | None,
           timeout: float) -> PageVisit:
    target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        pipe.send(f"{domain}.enable", session=session)
    if screenshot:
        pipe.send("Emulation.setDeviceMetricsOverride", {"width": screenshot[0], "height": screenshot[1],
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
    pipe.events.clear()
    pipe.send("Page.navigate", {"url": page.resolve().as_uri()}, session)
    pipe.wait_for("Page.loadEventFired", timeout)
    result = pipe.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
    visit = PageVisit(value=result.get("result", {}).get("value"))
    if "exceptionDetails" in result:
        visit.errors.append(f"evaluate: {result['exceptionDetails']}")
    if screenshot:
        shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session)
        visit.screenshot = base64.b64decode(shot["data"])
    pipe.send("Runtime.evaluate", {"expression": "1"}, session)  # drain events raised so far
    for event in pipe.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            visit.errors.append(f"console: {params.get('args')}")
        elif method == "Runtime.exceptionThrown":
            visit.errors.append(f"exception: {params.get('exceptionDetails')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            visit.errors.append(f"log: {params['entry'].get('text')}")
        elif method == "Network.requestWillBeSent":
            visit.requests.append(str(params.get("request", {}).get("url")))
    return visit


def png_colours(data: bytes) -> dict[tuple[int, int, int], int]:
    """How many pixels of each RGB colour a PNG has: enough to check what a screenshot shows.

    Reads the 8-bit RGB/RGBA, non-interlaced PNGs Chromium writes (stdlib only: zlib, and the
    five scanline filters of the PNG spec)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, chunks, header = 8, [], b""
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + size
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour_type, interlace = header[8], header[9], header[12]
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, header
    step = 3 if colour_type == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * step
    counts: dict[tuple[int, int, int], int] = {}
    previous = bytearray(stride)
    for row in range(height):
        start = row * (stride + 1)
        filter_type, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up, corner = previous[i], previous[i - step] if i >= step else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 0xFF
            elif filter_type == 2:
                line[i] = (line[i] + up) & 0xFF
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif filter_type == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        for i in range(0, stride, step):
            pixel = (line[i], line[i + 1], line[i + 2])
            counts[pixel] = counts.get(pixel, 0) + 1
        previous = line
    return counts
