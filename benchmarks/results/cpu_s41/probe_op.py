# Session 41: the varlen op's own host time per forward call on the agentic parallel-tools tree (T 10,240), on this
# repository's 2-core CPU, one thread: FA4's call stubbed (no kernel), tiny heads (D = 1); then with the gather stubbed.
# Run from the repository root: PYTHONPATH=. python benchmarks/results/cpu_s41/probe_op.py
import time, torch, cProfile, pstats
from benchmarks.trees import agentic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
torch.set_num_threads(1)
from benchmarks.trees import agentic_specs
spec = [s for s in agentic_specs() if s.name == "parallel-tools"][0]
paths = agentic_paths(spec)
tree = Tree.from_paths(paths)
b = tree.to_batch(pad_to_multiple=1024)
T = b.seq_len
print("T", T, tree.num_tokens)
H, Hkv, D = 16, 8, 1
q = torch.randn(1, T, H, D).transpose(1, 2)
k = torch.randn(1, T, Hkv, D).transpose(1, 2)
v = torch.randn(1, T, Hkv, D).transpose(1, 2)
plan = vta._plan(b.subtree_end, q)
print("segments", plan.segments, "G", plan.gathered, "tail", plan.tail)
vta._fwd = lambda q_t, kg, vg, plan, scale, out=None, lse=None: (out, lse)  # no kernel
def call():
    return torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.1, "none")
for _ in range(20): call()
t0 = time.perf_counter(); n = 200
for _ in range(n): call()
print("per call us", (time.perf_counter() - t0) / n * 1e6)
pr = cProfile.Profile(); pr.enable()
for _ in range(200): call()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
kk = (torch.empty(plan.gathered, Hkv, D), torch.empty(plan.gathered, Hkv, D))
type(plan).keys = lambda self, k_t, v_t: kk
for _ in range(20): call()
t0 = time.perf_counter(); n = 2000
for _ in range(n): call()
print("per call us, no gather", (time.perf_counter() - t0) / n * 1e6)
import treecompile.ops.varlen_tree_attention as m
t0 = time.perf_counter()
for _ in range(n): m._forward(q, k, v, plan, 0.1, False)
print("_forward alone us", (time.perf_counter() - t0) / n * 1e6)
t0 = time.perf_counter()
for _ in range(n): m._plan(b.subtree_end, q)
print("_plan us", (time.perf_counter() - t0) / n * 1e6)
t0 = time.perf_counter()
for _ in range(n): m._check(q, k, v, b.subtree_end)
print("_check us", (time.perf_counter() - t0) / n * 1e6)
