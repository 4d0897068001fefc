"""Host time of TreeProgram._run_cuda around the graph call, graph stubbed (a 28-layer dense model: 311 lifted
inputs like Qwen3-0.6B), with cProfile of the steady state."""
import cProfile, pstats, io, time, statistics, sys
sys.path.insert(0, "tests"); sys.path.insert(0, ".")  # run from the repository root
import torch
import treecompile
from treecompile import Tree
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.passes import lower_cuda as lc
from treecompile.program import _CudaState
from benchmarks import harness

torch.manual_seed(0)
cfg = DenseConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
model = DenseForCausalLM(cfg)
tm = treecompile.compile(model)
prog = tm.program
print("lifted", len(prog.lifted))
lc.fa4_unusable_reason = lambda q=None: None
lc.HALF = lc.HALF + (torch.float32,)
lc.AUTO_SEGMENTS_HEAD_DIMS = (16,)
low = lc.lower_cuda(prog.graph_module, lc.CudaOptions(compile_cuda=False, bucket=True, gdn_kernel="reference"))
out = (torch.zeros(()), torch.zeros(20000))
prog._cuda = _CudaState(low, lambda *args: out)
(case,) = harness.synthetic_cases([0.5], 16, 1024, 512)
tree = Tree.from_paths([list(p) for p in case.paths])
batch = tree.to_batch()
prog._prepare_cuda(batch)
ts = []
for _ in range(200):
    t = time.perf_counter(); prog._run_cuda(batch, []); ts.append(time.perf_counter() - t)
print(f"_run_cuda (prepared, graph stubbed): median {statistics.median(ts)*1e6:.0f} us")
ts = []
for _ in range(200):
    t = time.perf_counter(); batch.check_ids(tm.vocab_size); ts.append(time.perf_counter() - t)
print(f"check_ids: median {statistics.median(ts)*1e6:.0f} us")
ts = []
for _ in range(200):
    t = time.perf_counter(); [prog.lifted_value(x) for x in prog.lifted]; ts.append(time.perf_counter() - t)
print(f"lifted list: median {statistics.median(ts)*1e6:.0f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(100):
    prog._run_cuda(batch, [])
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:4000])
