"""Run from the repository root: python benchmarks/results/2026-11-29-z1-gloo/host_calls.py
ddp-compile ours-z1 ours-z1+overlap. Per steady optimizer step on 2 gloo ranks, tiny Llama, AdamW, Inductor: Python function calls
(all code), C calls, and collectives, for ours-z1 (+bucket_reduce+overlap_refresh) and
torch.compile(DDP). With TORCH_PROFILE=1, rank 0 first prints torch.profiler's table of 20
steady steps."""
import os, sys, functools, collections, json
import torch, torch.distributed as dist, torch.multiprocessing as mp
ROOT = os.path.dirname(os.path.abspath(__file__)).rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, os.path.join(ROOT, "tests"))

def count(fn):
    c = collections.Counter()
    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            key = "deepcompile" if "/deepcompile/" in f else ("torch" if "/torch/" in f else ("generated" if f.startswith("<") or "inductor-cache" in f or "/tmp/" in f else "other"))
            c["py:" + key] += 1
        elif event == "c_call":
            c["c"] += 1
    sys.setprofile(prof)
    try: fn()
    finally: sys.setprofile(None)
    return dict(c)

def worker(rank, world, port, system, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                      TORCHINDUCTOR_CACHE_DIR=os.path.join(ROOT, "build", "inductor-cache"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import _models
    model = _models.build_model("llama")
    gas = 1
    mk = lambda m: _models.local_batch("llama", m, rank, world)
    if system == "ddp-compile":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        cm = torch.compile(ddp)
        state = {"m": 0}
        def step():
            loss = _models.loss_of(cm(**mk(state["m"]))); loss.backward(); state["m"] += 1
            opt.step(); opt.zero_grad(set_to_none=True)
        n_coll = None
    else:
        import deepcompile
        passes = {"ours-z1": ("bucket_reduce",), "ours-z1+overlap": ("bucket_reduce", "overlap_refresh")}[system]
        eng = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                     config={"compiler": "inductor", "zero_stage": 1, "passes": passes,
                                             "warmup_steps": 1, "measure_steps": 0})
        state = {"m": 0}
        def step():
            eng.backward(_models.loss_of(eng(**mk(state["m"])))); state["m"] += 1
            eng.step()
    for _ in range(8):
        step()
    if os.environ.get("TORCH_PROFILE") == "1":   # where the time goes: 20 steady steps
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step()
        if rank == 0:
            print(system, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
                  flush=True)
    if system != "ddp-compile":
        assert eng.report().phase == "steady", eng.report().phase
        before = eng.comm_stats()
    res = count(step)
    if system != "ddp-compile":
        after = eng.comm_stats()
        res["collectives"] = {k: after[k]["count"] - before.get(k, {"count": 0})["count"] for k in after}
        res["passes"] = [(e["pass"], e.get("kept")) for e in eng._pipeline.pass_log]
    q.put((rank, res))
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for system in sys.argv[1:]:
        from deepcompile.tools.spawn import free_port
        q = ctx.Queue(); port = free_port()
        ps = [ctx.Process(target=worker, args=(r, 2, port, system, q)) for r in range(2)]
        [p.start() for p in ps]
        out = dict(q.get() for _ in ps)
        [p.join() for p in ps]
        print(system, json.dumps(out[0]))
