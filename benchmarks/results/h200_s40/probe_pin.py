"""Session 40 probe: what a host-to-device table costs on the H200 host, by part (probe_plan.txt: the plan's 22
``aten::copy_`` took 2.6-3.2 ms, ``pin_memory`` + H2D of 32 KB 0.3 ms).  Median of 9, the GPU idle, a 50 ms
sleep before each (threads asleep, as between steps)."""
import statistics
import time

import torch


def med(fn, n=9, sleep=0.05):
    ts = []
    for _ in range(n):
        time.sleep(sleep)
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return f"median {statistics.median(ts) * 1e3:.0f} us (min {min(ts) * 1e3:.0f})"


torch.cuda.init()
x = torch.arange(4096)
big = torch.arange(1 << 17)
pinned = torch.empty(4096, dtype=torch.int64, pin_memory=True)
torch.empty(1, device="cuda")
for name, fn in [
    ("is_pinned (pageable)", lambda: x.is_pinned()),
    ("is_pinned (pinned)", lambda: pinned.is_pinned()),
    ("empty(pin_memory=True) 32 KB", lambda: torch.empty(4096, dtype=torch.int64, pin_memory=True)),
    ("empty(pin_memory=True) + copy_ 32 KB", lambda: torch.empty(4096, dtype=torch.int64, pin_memory=True).copy_(x)),
    ("pin_memory() 32 KB", lambda: x.pin_memory()),
    ("pin_memory() 1 MB", lambda: big.pin_memory()),
    ("pinned.to(cuda, non_blocking) 32 KB", lambda: pinned.to("cuda", non_blocking=True)),
    ("empty(cuda).copy_(pinned, non_blocking) 32 KB", lambda: torch.empty(4096, dtype=torch.int64, device="cuda").copy_(pinned, non_blocking=True)),
    ("pin_memory().to(cuda, non_blocking) 32 KB", lambda: x.pin_memory().to("cuda", non_blocking=True)),
    ("x.to(cuda) pageable, blocking 32 KB", lambda: x.to("cuda")),
    ("empty(pin)+copy_+to(cuda) 32 KB", lambda: torch.empty(4096, dtype=torch.int64, pin_memory=True).copy_(x).to("cuda", non_blocking=True)),
    ("empty cuda 32 KB", lambda: torch.empty(4096, dtype=torch.int64, device="cuda")),
    ("x.clone() 32 KB", lambda: x.clone()),
]:
    print(f"{name}: {med(fn)}", flush=True)
# back to back, no sleep: the allocator's cost without the sleep's cold caches
print("back to back, pin_memory().to(cuda) 32 KB:", med(lambda: x.pin_memory().to("cuda", non_blocking=True), sleep=0))
print("back to back, is_pinned:", med(lambda: x.is_pinned(), sleep=0))
