#!/usr/bin/env bash
# Builds the browser demo into <target>/web-demo/ (<target> is cargo's target directory: target/, or
# CARGO_TARGET_DIR): the example compiled for wasm32-unknown-unknown, its JS bindings from wasm-bindgen
# (the version in Cargo.lock), and index.html. Serve that folder over HTTP (for example
# `python3 -m http.server -d target/web-demo -b 127.0.0.1 8000`) and open it in a browser with WebGPU;
# examples/web/check.py does that headlessly. `build.sh --print-out-dir` prints the folder and builds
# nothing (CI checks it follows CARGO_TARGET_DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
target=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
out="$target/web-demo"
if [ "${1:-}" = "--print-out-dir" ]; then
  echo "$out"
  exit 0
fi
cargo build --release --example web --target wasm32-unknown-unknown
rm -rf "$out"
mkdir -p "$out"
wasm-bindgen --target web --no-typescript --out-dir "$out/pkg" \
  "$target/wasm32-unknown-unknown/release/examples/web.wasm"
cp examples/web/index.html "$out/"
echo "built $out"
