"""After the merge: a small dense model (head_dim 128) compiled with attention_kernel fa4 / flex vs an fp32 per-path oracle."""
import copy, json, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
import torch._dynamo.utils as du
from gpu_checks import branching_paths, init_, flat_grads
import treecompile
from treecompile import Tree, reference
from treecompile.models import DenseConfig, DenseForCausalLM

torch.manual_seed(0)
cfg = DenseConfig.tiny(vocab_size=2000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128)
paths = branching_paths(8, prompt=1500, seg=700, vocab=cfg.vocab_size, seed=2)
model = init_(DenseForCausalLM(cfg)).to("cuda", torch.bfloat16)
batch = Tree.from_paths(paths).to_batch(device="cuda")
n = len(paths)
def per_path(m):
    m.zero_grad(set_to_none=True); tot = 0.0
    for p in paths:
        l = reference.run(m, [p], device="cuda").loss / n; l.backward(); tot += float(l)
    return tot, flat_grads(m)
m32 = copy.deepcopy(model).float(); l32, g32 = per_path(m32); del m32
lb, gb = per_path(model)
res = {"T": batch.num_tokens, "paths": n, "bf16 per-path": {"loss_rel": abs(lb - l32) / abs(l32), "cos": float(F.cosine_similarity(gb, g32, dim=0))}}
for kernel in ("fa4", "flex"):
    for cc in (True, False):
        t0 = time.perf_counter()
        tm = treecompile.compile(model, attention_kernel=kernel, compile_cuda=cc)
        model.zero_grad(set_to_none=True)
        du.counters.clear()
        out = tm(batch); out.loss.backward()
        g = flat_grads(model)
        gb_ = {k: dict(v) for k, v in du.counters.items() if k in ("graph_break", "stats")}
        res[f"tree {kernel} compiled={cc}"] = {"loss_rel": abs(float(out.loss) - l32) / abs(l32),
                                                "cos": float(F.cosine_similarity(g, g32, dim=0)), "s": round(time.perf_counter() - t0, 1), "dynamo": gb_}
        print(json.dumps(res), flush=True)
