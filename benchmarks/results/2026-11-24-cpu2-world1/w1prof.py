import os, sys, time, functools, statistics
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1")
import torch
torch.set_num_threads(1)
from deepcompile._bench import workloads
from torch.profiler import profile, ProfilerActivity
which = sys.argv[1]; wl = sys.argv[2] if len(sys.argv) > 2 else "small-llama"
w = workloads.get(wl)
model = workloads.build_model(w, "cpu")
if which == "compile":
    mod = torch.compile(model); opt = workloads.make_optimizer(model.parameters())
    def micro(ids):
        loss = mod(input_ids=ids, labels=ids).loss; loss.backward(); return loss
    def step():
        opt.step(); opt.zero_grad(set_to_none=True)
else:
    import deepcompile
    passes = [] if which == "z3" else ("auto" if which == "auto" else which.split(","))
    eng = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, **workloads.ADAMW),
        config=deepcompile.Config(zero_stage=3, passes=passes, compiler="inductor"))
    def micro(ids):
        out = eng(input_ids=ids, labels=ids); eng.backward(out.loss); return out.loss
    def step():
        eng.step()
ids = workloads.local_batch(w, 0, 0, 1)
for i in range(12):
    micro(ids); step()
if which != "compile":
    print("phase", eng.report().phase)
ts = []
for i in range(10):
    t = time.perf_counter(); micro(ids); step(); ts.append(time.perf_counter() - t)
print(which, "median step ms", round(statistics.median(ts) * 1e3, 2), [round(x*1e3,1) for x in ts])
with profile(activities=[ProfilerActivity.CPU]) as p:
    for i in range(5):
        micro(ids); step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
