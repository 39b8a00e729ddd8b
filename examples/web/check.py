#!/usr/bin/env python3
"""Loads the demo page (built by examples/web/build.sh into <target>/web-demo/, <target> being cargo's
target directory: target/ or CARGO_TARGET_DIR) in headless Chromium and checks the verification line
it shows.

Serves the folder on 127.0.0.1, starts chromedriver on 127.0.0.1, opens a session with the Chromium
options of webdriver.json (the ones the browser suite uses), waits for #result to leave "running…", and
fails unless it reads `verified: N steps, max abs error 0` with N > 0. Standard library only.
"""

import functools
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = 120


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


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


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
    page = f"http://127.0.0.1:{server.server_address[1]}/index.html"

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
        session = call(base, "POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        call(base, "POST", f"/session/{session}/url", {"url": page})
        text = ""
        deadline = time.time() + TIMEOUT_S
        script = "const e = document.getElementById(arguments[0]); return e ? e.textContent : '';"
        while time.time() < deadline:
            text = call(base, "POST", f"/session/{session}/execute/sync", {"script": script, "args": ["result"]})
            if text and not text.startswith("running"):
                break
            time.sleep(0.5)
        log = call(base, "POST", f"/session/{session}/execute/sync", {"script": script, "args": ["log"]})
        print(log)
        print(text)
        m = re.fullmatch(r"verified: (\d+) steps, max abs error (\S+)", text or "")
        if not m or int(m.group(1)) == 0 or float(m.group(2)) != 0.0:
            sys.exit(f"FAIL: the demo page shows {text!r}, not a verification line")
        if not re.search(r"^adapter: .+", log or "", re.M) or "cache: " not in log or " ms" not in log:
            sys.exit("FAIL: the demo page lacks the adapter, the cache size or the step timings")
        print(f"demo page OK: {page}")
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
