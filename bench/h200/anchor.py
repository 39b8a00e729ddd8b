# PyTorch on the same GPU, at the shapes of kvgpu-bench's long part: copy roofline (read+write),
# SDPA with GQA (Llama-3-8B layer: 32 q heads, 8 kv heads, d=128, one query), absorbed MLA as matmuls.
import math, statistics, sys, time, torch, torch.nn.functional as F
from triton.testing import do_bench
dev = "cuda"
def bw(nbytes, ms): return nbytes / (ms * 1e-3) / 1e9
# do_bench times each call alone between CUDA events, with the L2 cache cleared before it. kvgpu's
# long part times calls back to back: samples of about 2 ms of calls (at most 64) after 0.5 s of the
# same work, the median of 9 (of a full run). b2b times PyTorch that way too, so both methods can be set side by side.
def b2b(f):
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end: f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); f(); e.record(); torch.cuda.synchronize()
    n = max(1, min(64, math.ceil(2.0 / max(s.elapsed_time(e), 1e-4))))
    samples = []
    for _ in range(9):
        s.record()
        for _ in range(n): f()
        e.record(); torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) / n)
    return statistics.median(samples)
a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
print(f"copy roofline 1 GiB: {bw(2 * a.numel(), ms):.0f} GB/s (read+write)", flush=True)
del a, b
for dt in (torch.float16, torch.float32):
    for ctx, batch in ((4096, 1), (16384, 1), (32768, 1), (65536, 1), (131072, 1), (4096, 16), (16384, 16)):
        q = torch.randn(batch, 32, 1, 128, device=dev, dtype=dt)
        k = torch.randn(batch, 8, ctx, 128, device=dev, dtype=dt)
        v = torch.randn(batch, 8, ctx, 128, device=dev, dtype=dt)
        f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ms = do_bench(f, warmup=25, rep=150, return_mode="median")
        nbytes = k.numel() * k.element_size() * 2
        print(f"torch SDPA GQA {str(dt)[6:]} ctx {ctx} batch {batch}: {ms*1e3:.1f} us, {bw(nbytes, ms):.0f} GB/s", flush=True)
        ms = b2b(f)
        print(f"torch SDPA GQA {str(dt)[6:]} ctx {ctx} batch {batch}, back to back: {ms*1e3:.1f} us, {bw(nbytes, ms):.0f} GB/s", flush=True)
        del q, k, v
    for ctx in (4096, 16384, 32768, 65536, 131072):
        ql = torch.randn(16, 512, device=dev, dtype=dt); qr = torch.randn(16, 64, device=dev, dtype=dt)
        c = torch.randn(ctx, 512, device=dev, dtype=dt); pe = torch.randn(ctx, 64, device=dev, dtype=dt)
        def mla():
            s = (ql @ c.T + qr @ pe.T) * 0.1
            return torch.softmax(s.float(), -1).to(dt) @ c
        ms = do_bench(mla, warmup=25, rep=150, return_mode="median")
        nbytes = (c.numel() + pe.numel()) * c.element_size()
        print(f"torch MLA absorbed {str(dt)[6:]} ctx {ctx}: {ms*1e3:.1f} us, {bw(nbytes, ms):.0f} GB/s", flush=True)
        ms = b2b(mla)
        print(f"torch MLA absorbed {str(dt)[6:]} ctx {ctx}, back to back: {ms*1e3:.1f} us, {bw(nbytes, ms):.0f} GB/s", flush=True)
