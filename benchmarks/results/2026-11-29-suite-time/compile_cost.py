"""One engine's setup (ZeRO-3, fx, no pass, 4 optimizer steps, world size 1) on the tests' models, 3 rounds
in one process, alternating: what a scenario of the suite costs per model (README.md here)."""
import sys, time, os, functools
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"), os.path.dirname(os.path.abspath(__file__))]
import torch, torch.distributed as dist
import _models, plain_llama, deepcompile
import tempfile
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
# a first compile builds the tables every later one uses (the tests' fork server does the same)
_models.loss_of(torch.compile(_models.build_model("mlp"), backend="aot_eager")(**_models.local_batch("mlp",0,0,1))).backward()
torch._dynamo.reset()
res = {}
for rep in range(3):
    for name, mk in [("hf1", lambda: _models._llama(False, 1)), ("hf2", lambda: _models._llama(False, 2)),
                     ("hf4", lambda: _models._llama(False, 4)), ("plain2", lambda: plain_llama.Llama()),
                     ("mlp", lambda: _models.build_model("mlp"))]:
        torch.manual_seed(0); model = mk()
        kind = "mlp" if name == "mlp" else "llama"
        t0 = time.perf_counter()
        eng = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
            config=deepcompile.Config(zero_stage=3, compiler="fx", passes=(), measure_steps=0))
        for i in range(4):
            loss = _models.loss_of(eng(**_models.local_batch(kind, i, 0, 1))); eng.backward(loss); eng.step()
        res.setdefault(name, []).append(time.perf_counter() - t0)
        del eng; torch._dynamo.reset()
for k, v in res.items(): print(k, " ".join(f"{x:.2f}" for x in v), "min %.2f" % min(v))
