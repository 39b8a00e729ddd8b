#!/usr/bin/env python3
"""Drives the demo page (built by examples/web/build.sh into <target>/web-demo/, <target> being cargo's
target directory: target/ or CARGO_TARGET_DIR) in headless Chromium the way a visitor would, and checks
what it shows.

Serves the folder on 127.0.0.1, starts chromedriver on 127.0.0.1 and opens a session with the Chromium
options of webdriver.json (the ones the browser suite uses). For each run in RUNS it picks the model
shape, storage type and context length by clicking their options, presses Run, and fails unless the
page shows `verified: N steps, max abs error E (preset, dtype, context C; ...)` with N = 33, E within
the tolerance and the choices it made; the adapter, cache and decode lines in the log; and a chart
that is drawn: its SVG lines have one point per decode step, and the chart's screenshot holds pixels of
the time line's colour in the left panel and of the memory line's colour in the right one. Screenshots
of the chart and the page are written to <target>/web-demo/. Standard library only.
"""

import base64
import functools
import http.server
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = 120
# (model shape, storage type, context length): the page's <select> values, one Run each.
RUNS = [("mla", "bf16", "256"), ("gqa", "f32", "128")]
DECODE_STEPS = 32
# The largest max abs error accepted: the page's own check is 1e-4 * (1 + |reference|) per output.
MAX_ERR = 1e-3
# The chart's line colours (examples/web/chart.rs): time per step, memory in use.
TIME_RGB = (0x1F, 0x77, 0xB4)
IN_USE_RGB = (0x2C, 0xA0, 0x2C)
# Pixels of a line's colour a drawn panel has at least (a 2.5-pixel line across ~300 pixels has ~700).
MIN_PIXELS = 150


def site():
    """<target>/web-demo, with cargo's own answer for the target directory (as build.sh asks it)."""
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return os.path.join(json.loads(meta.stdout)["target_directory"], "web-demo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read() or b"{}").get("value")


def png_pixels(data):
    """(width, height, rows of (r, g, b)) of an 8-bit RGB or RGBA PNG, as WebDriver screenshots are."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, head = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    width, height, depth, colour, _, _, interlace = head
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([tuple(line[x * bpp : x * bpp + 3]) for x in range(width)])
        prev = line
    return width, height, rows


def count_colour(rows, x0, x1, rgb, tol=40):
    """Pixels in columns [x0, x1) within `tol` of `rgb` in every channel."""
    return sum(
        1
        for row in rows
        for px in row[x0:x1]
        if all(abs(p - q) <= tol for p, q in zip(px, rgb))
    )


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Page:
    def __init__(self, base, session):
        self.base, self.session = base, session

    def do(self, method, path, body=None):
        return call(self.base, method, f"/session/{self.session}{path}", body)

    def js(self, script, *args):
        return self.do("POST", "/execute/sync", {"script": script, "args": list(args)})

    def text(self, id_):
        return self.js("const e = document.getElementById(arguments[0]); return e ? e.textContent : '';", id_)

    def find(self, css):
        found = self.do("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))

    def click(self, css):
        self.do("POST", f"/element/{self.find(css)}/click", {})

    def wait_result(self, done):
        deadline = time.time() + TIMEOUT_S
        text = ""
        while time.time() < deadline:
            text = self.text("result")
            if text and done(text):
                return text
            time.sleep(0.25)
        return text


def check_run(page, out_dir, preset, dtype, context):
    """One visitor's run: pick the three options, press Run, check the result line, log and chart."""
    for sel, value in (("preset", preset), ("dtype", dtype), ("context", context)):
        page.click(f"#{sel} option[value='{value}']")
        got = page.js("return document.getElementById(arguments[0]).value;", sel)
        if got != value:
            sys.exit(f"FAIL: clicking option {value!r} of #{sel} left it at {got!r}")
    t0 = time.time()
    page.click("#run")
    text = page.wait_result(lambda t: t.startswith(("verified", "error")))
    seconds = time.time() - t0
    log = page.text("log")
    print(log)
    print(f"{text}  [{seconds:.1f} s in the browser]")
    m = re.match(
        r"verified: (\d+) steps, max abs error (\S+) \((\w+), (\w+), context (\d+);", text or ""
    )
    if not m:
        sys.exit(f"FAIL: the demo page shows {text!r}, not a verification line")
    steps, err = int(m.group(1)), float(m.group(2))
    if steps != DECODE_STEPS + 1 or not err <= MAX_ERR:
        sys.exit(f"FAIL: {steps} steps checked (want {DECODE_STEPS + 1}), max abs error {err} (want <= {MAX_ERR})")
    if m.group(3, 4, 5) != (preset, dtype, context):
        sys.exit(f"FAIL: the page ran {m.group(3, 4, 5)}, not the options picked {(preset, dtype, context)}")
    for want in (r"^adapter: .+", r"^cache: .+", r"^prefill: \d+ tokens", r"^decode: 32 steps .* ms per step"):
        if not re.search(want, log or "", re.M):
            sys.exit(f"FAIL: the log lacks a line matching {want!r}")

    points = page.js(
        "return ['time-line', 'memory-line'].map((id) => {"
        " const e = document.getElementById(id); return e ? Number(e.dataset.points) : 0; });"
    )
    if points != [DECODE_STEPS, DECODE_STEPS + 2]:
        sys.exit(f"FAIL: the chart's lines have {points} points, want [{DECODE_STEPS}, {DECODE_STEPS + 2}]")
    png = base64.b64decode(page.do("GET", f"/element/{page.find('#chart-svg')}/screenshot"))
    name = f"chart-{preset}-{dtype}-{context}.png"
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(png)
    width, _, rows = png_pixels(png)
    left = count_colour(rows, 0, width // 2, TIME_RGB)
    right = count_colour(rows, width // 2, width, IN_USE_RGB)
    print(f"chart screenshot {name}: {width} px wide, {left} time-line pixels left, {right} memory-line pixels right")
    if left < MIN_PIXELS or right < MIN_PIXELS:
        sys.exit(f"FAIL: the chart is not drawn ({left} and {right} line pixels, want >= {MIN_PIXELS} each)")
    return seconds


def main():
    site_dir = site()
    if not os.path.isfile(os.path.join(site_dir, "pkg", "web_bg.wasm")):
        sys.exit(f"FAIL: {site_dir} is not built; run bash examples/web/build.sh first")
    with open(os.path.join(ROOT, "webdriver.json")) as f:
        caps = json.load(f)

    Quiet.extensions_map = {**Quiet.extensions_map, ".wasm": "application/wasm", ".js": "text/javascript"}
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=site_dir)
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/index.html"

    port = free_port()
    driver = subprocess.Popen(
        [os.environ.get("CHROMEDRIVER", "chromedriver"), f"--port={port}", "--allowed-ips=127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    session = None
    try:
        for _ in range(100):
            try:
                call(base, "GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        caps = json.loads(json.dumps(caps))
        caps["goog:chromeOptions"]["args"].append("--window-size=1100,1000")
        session = call(base, "POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        page = Page(base, session)
        page.do("POST", "/url", {"url": url})
        ready = page.wait_result(lambda t: not t.startswith("loading"))
        if not ready.startswith("ready"):
            print(page.text("log"))
            sys.exit(f"FAIL: the demo page shows {ready!r} instead of getting ready")
        for run in RUNS:
            check_run(page, site_dir, *run)
        with open(os.path.join(site_dir, "page.png"), "wb") as f:
            f.write(base64.b64decode(page.do("GET", "/screenshot")))
        print(f"demo page OK: {url}; screenshots in {site_dir}")
    finally:
        if session:
            try:
                call(base, "DELETE", f"/session/{session}")
            except OSError:
                pass
        driver.terminate()
        driver.wait(timeout=10)
        server.shutdown()


if __name__ == "__main__":
    main()
