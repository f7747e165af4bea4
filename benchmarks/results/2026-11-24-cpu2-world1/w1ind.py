import os, sys, functools
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29547", RANK="0", WORLD_SIZE="1")
sys.path.insert(0, "tests")
import torch, _models, deepcompile
torch.set_num_threads(1)
def train(passes, comp):
    torch.manual_seed(0)
    e = deepcompile.initialize(_models.build_model("llama"), functools.partial(torch.optim.AdamW, lr=1e-2),
        deepcompile.Config(compiler=comp, passes=passes, param_dtype=torch.bfloat16, gradient_accumulation_steps=2, measure_steps=0))
    L = []
    for i in range(14):
        for m in range(2):
            loss = _models.loss_of(e(**_models.local_batch("llama", 2*i+m, 0, 1))); e.backward(loss); L.append(loss.item())
        e.step()
    torch._dynamo.reset()
    return L
for comp in ("fx", "inductor"):
    a, b = train((), comp), train(("selective_unshard",), comp)
    print(comp, "equal" if a == b else f"max diff {max(abs(x-y) for x,y in zip(a,b)):.2e}")
f = train((), "fx"); i0 = train((), "inductor"); i1 = train(("selective_unshard",), "inductor")
d = lambda a, b: max(abs(x-y) for x, y in zip(a, b))
print(f"fx vs inductor without keeping {d(f, i0):.2e}; fx vs inductor keeping {d(f, i1):.2e}")
