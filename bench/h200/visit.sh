#!/usr/bin/env bash
# One visit to a lent NVIDIA H200 (the `device` tool; see ../shared/tools/h200/README.md for the
# `.gl` loaders and the `.h200/bin.tgz` layout): the long part of the bench per kernel choice and
# workgroup target, PyTorch on the same GPU at the same shapes, then the test suites on Vulkan and
# OpenGL. Built here, run there:
#   cargo build --release -p kvgpu-bench && cargo build --release --examples
#   cargo test --release --no-run
#   copy target/release/kvgpu-bench, target/release/examples/decode and the test binaries (renamed
#   test-<name>) into .h200/bin,
#   strip them, tar czf .h200/bin.tgz -C .h200 bin
#   device run: command "bash bench/h200/visit.sh", carry [".gl", ".h200/bin.tgz"], timeout_s 540
# Everything it measures lands in $OUT (at most 8 files come back). About 6 minutes.
# TORCH=0 and TESTS=0 leave out PyTorch and the suites (a sweep alone, when device time is short).
# Every step is killed 5 s after its time is up: on 2026-12-04 the OpenGL step outlived its
# `timeout` and the visit ran past the device tool's limit (a call to the still warm machine read
# the Vulkan suites' results back from /tmp/vk-test-*.txt).
set -u
exec > >(tee -a "$OUT/log.txt") 2>&1
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
tar xzf .h200/bin.tgz -C .h200
export XDG_RUNTIME_DIR=/tmp WGPU_DEBUG=0 RUST_BACKTRACE=1
nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ ! -e /usr/share/vulkan/icd.d/nvidia_icd.json ] && [ ! -e /etc/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=$nvidia_icd
fi
# OpenGL goes through EGL, whose vendor file the driver's mount holds.
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/share/glvnd/egl_vendor.d 2>&1 | head
B=.h200/bin
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }
log() { echo "[$(el)s] $*"; }
# Cold start, before anything else compiles: a fresh machine's driver has no shader cache, so the
# first decode of each model compiles its pipelines (`prepare`'s line); the second finds them cached.
if [ -x $B/decode ]; then
  for m in llama3-8b deepseek-v2-lite; do
    for run in cold warm; do
      echo "$m f16 $run: $(WGPU_BACKEND=vulkan timeout -k 5 60 $B/decode --model $m --tokens 8 --prompt 16 \
        --dtype f16 2>&1 | grep -E 'pipelines|verified|rror' | tr '\n' ' ')" | tee -a "$OUT/long.txt"
    done
  done
fi
# [build/]kernel choice:workgroup target (`default`: the adapter's); `build/` runs
# $B/kvgpu-bench-<build> in place of $B/kvgpu-bench (builds of other constants, side by side).
# Starts stop after LIMIT seconds.
for cfg in ${CONFIGS:-auto:default subgroup:4096 subgroup:16384 shared:default shared:4096 shared:16384 tiled:4096}; do
  [ "$(el)" -lt "${LIMIT:-200}" ] || break
  bench=$B/kvgpu-bench
  case $cfg in */*) bench=$B/kvgpu-bench-${cfg%%/*} cfg=${cfg#*/} ;; esac
  k=${cfg%:*} w=${cfg#*:}
  log "long part, $(basename "$bench"), kernel $k, workgroups $w"
  if [ "$w" = default ]; then unset KVGPU_BENCH_WORKGROUPS; else export KVGPU_BENCH_WORKGROUPS=$w; fi
  KVGPU_BENCH_KERNEL=$k WGPU_BACKEND=vulkan timeout -k 5 90 $bench --only long \
    --json /tmp/long.json --plot /tmp/long.svg > /tmp/long.txt 2>&1
  echo "rc=$?"
  grep -E 'us \(|skipped|rror' /tmp/long.txt | sed -e 's/ layer attention//' -e 's/Llama-3-8B //' \
    -e 's/DeepSeek-V2-Lite //' | sed "s/^/$(basename "$bench") $k $w: /" | tee -a "$OUT/long.txt"
done
unset KVGPU_BENCH_WORKGROUPS
[ "${TORCH:-1}" = 0 ] || {
log "PyTorch"
PYTHONUNBUFFERED=1 timeout -k 5 180 python3 bench/h200/anchor.py 2>&1 | tee "$OUT/torch.txt"
}
[ "${TESTS:-1}" = 0 ] && { log done; exit 0; }
log "tests on Vulkan"
export RUSTC_BOOTSTRAP=1 # for libtest's --report-time
for t in $B/test-*; do
  WGPU_BACKEND=vulkan timeout -k 5 120 "$t" --test-threads=4 -Z unstable-options --report-time \
    > "/tmp/vk-$(basename "$t").txt" 2>&1 &
done
wait
cat /tmp/vk-test-*.txt > "$OUT/tests-vulkan.txt"
for f in /tmp/vk-test-*.txt; do echo "$(basename "$f"): $(grep -E '^test result' "$f")"; done
grep -hE 'FAILED|panicked' /tmp/vk-test-*.txt | head -10
echo "slowest:"
grep -hE '^test .* ok <[0-9.]+s>' /tmp/vk-test-*.txt | awk -F'<' '{print $2, $1}' | sort -n | tail -6
log "attention tests on OpenGL"
WGPU_BACKEND=gl timeout -k 5 "${GL_SECONDS:-100}" $B/test-attention --test-threads=1 > "$OUT/tests-gl.txt" 2>&1
grep -E '^test result|panicked|found none' "$OUT/tests-gl.txt" | head -5
log done
