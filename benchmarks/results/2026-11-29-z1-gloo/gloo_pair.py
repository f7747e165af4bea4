"""Run: python -W ignore benchmarks/results/2026-11-29-z1-gloo/gloo_pair.py. Paired on 2 gloo ranks: one all_reduce of N floats vs reduce_scatter_tensor + all_gather_into_tensor
of the same N (ZeRO-1's pair), and the pair plus the cross-rank check's all_reduce of 10
int64, interleaved in rotated order, medians of 80 rounds each."""
import os, sys, time, statistics
import torch, torch.distributed as dist, torch.multiprocessing as mp
def worker(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1); dist.init_process_group("gloo")
    out = {}
    for n in (26_784, 1_000_000):
        x = torch.randn(n); half = torch.empty(n // 2); full = torch.empty(n)
        ar, rsag, z1 = [], [], []
        vec = torch.zeros(10, dtype=torch.int64)
        for r in range(90):
            for which in ((0, 1, 2), (1, 2, 0), (2, 0, 1))[r % 3]:
                dist.barrier(); t = time.perf_counter()
                if which == 0:
                    dist.all_reduce(x)
                else:
                    dist.reduce_scatter_tensor(half, x); dist.all_gather_into_tensor(full, half)
                    if which == 2:
                        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
                dt = time.perf_counter() - t
                (ar, rsag, z1)[which].append(dt)
        out[n] = tuple(statistics.median(v[10:]) * 1e3 for v in (ar, rsag, z1))
    q.put((rank, out)); dist.destroy_process_group()
if __name__ == "__main__":
    from deepcompile.tools.spawn import free_port
    ctx = mp.get_context("spawn"); q = ctx.Queue(); port = free_port()
    ps = [ctx.Process(target=worker, args=(r, port, q)) for r in range(2)]; [p.start() for p in ps]
    res = dict(q.get() for _ in ps); [p.join() for p in ps]
    for n, (a, b, c) in res[0].items():
        print(f"n={n}: all_reduce {a:.3f} ms | reduce_scatter+all_gather {b:.3f} ms ({b/a:.2f}x) | + check all_reduce(10 x int64) {c:.3f} ms ({c/a:.2f}x)")
