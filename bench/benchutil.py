"""Timing helpers shared by the benchmark drivers (the method in BENCHMARKS.md): CUDA-event and
CUDA-Graph timings, and the streaming bandwidth ceilings measured in the same run."""

import time

import torch

GIB = 1 << 30
DEV = torch.device("cuda")
CU_STREAM_LEGACY = 1  # the legacy default stream's handle; torch reports it as 0


def cur_stream():
    """torch's current stream as a CUstream; NULL would mean kvreplay's own stream."""
    return torch.cuda.current_stream().cuda_stream or CU_STREAM_LEGACY


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_eager(fn, n_sets, iters):
    """Median per-call time (us) with events around each call."""
    for i in range(max(3, n_sets)):
        fn(i % n_sets)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(i % n_sets)
        b.record()
    torch.cuda.synchronize()
    return median([a.elapsed_time(b) * 1000.0 for a, b in ev])


def settle():
    """Empties torch's cache and waits for the driver. torch.cuda.graph's entry calls
    torch.cuda.empty_cache(); memory handed back to the driver is then worked on in the
    background for a while (about 2 s after freeing 8 GiB on the H200), and whatever is timed
    meanwhile reads up to 15 % slower. The benchmarks' old "allocation effect" at 2-8 GiB was
    this, paid by whichever implementation was timed first (BENCHMARKS.md, issue 15). So the
    cache is emptied here, and the wait is in proportion to what was freed."""
    before = torch.cuda.memory_reserved()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_reserved()
    if freed > (64 << 20):
        time.sleep(min(5.0, 0.5 + 0.3 * freed / GIB))
    return freed


def time_graph(fn, n_sets, calls, replays=7, warm=True):
    """Per-call time (us) under CUDA Graph replay of `calls` calls rotating over the sets.
    With warm=False the calls are not run before capture (for stateful calls whose warm-up
    the caller does itself). Starts with settle()."""
    settle()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        if warm:
            with torch.cuda.stream(s):
                for i in range(n_sets):
                    fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i % n_sets)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1000.0 / calls)
        del g
        return median(ts)
    except Exception as e:  # noqa: BLE001 - report, do not stop the run
        print(f"  graph capture failed: {type(e).__name__}: {e}", flush=True)
        torch.cuda.synchronize()
        return None


def profile_graph(fn, n_sets, steps, warm=True):
    """A graph of `steps` rounds of fn(i) over the n_sets sets, captured (and replayed once
    if `warm`); then one replay under torch.profiler (CUPTI): the kvr_ kernels' records, by
    start time; and one timed by events: us per call of fn."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            for i in range(n_sets):
                fn(i)
    if warm:
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("kvr_")]
    ev.sort(key=lambda e: e.time_range.start)
    return ev, a.elapsed_time(b) * 1000.0 / (steps * n_sets)


def read_ceiling():
    """Read-only streaming bandwidth (TB/s): torch.sum over 2 GiB."""
    x = torch.empty((2 * GIB) // 2, dtype=torch.bfloat16, device=DEV)
    x.normal_()
    t = time_eager(lambda i: x.sum(), 1, 20)
    del x
    torch.cuda.empty_cache()
    return 2 * GIB / (t * 1e-6) / 1e12


def inplace_ceiling():
    """In-place read-modify-write bandwidth (TB/s, both directions counted): x *= c on 1 GiB,
    the access pattern of a state updated where it lives."""
    x = torch.empty(GIB // 4, dtype=torch.float32, device=DEV)
    x.normal_()
    t = time_eager(lambda i: x.mul_(1.0), 1, 20)
    del x
    torch.cuda.empty_cache()
    return 2 * GIB / (t * 1e-6) / 1e12


def copy_ceiling():
    """Read + write streaming bandwidth (TB/s, both directions counted): a 1 GiB copy."""
    x = torch.empty(GIB // 4, dtype=torch.float32, device=DEV)
    y = torch.empty_like(x)
    x.normal_()
    t = time_eager(lambda i: y.copy_(x), 1, 20)
    del x, y
    torch.cuda.empty_cache()
    return 2 * GIB / (t * 1e-6) / 1e12
