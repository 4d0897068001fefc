# Session 42: torch calls (aten dispatches) per forward call of the varlen op on the agentic parallel-tools tree (T 10,240
# with a padding tail), FA4's call stubbed, tiny heads, this repository's CPU.  The first line counts what a
# dispatch mode outside the custom op sees (the op alone); the second the op's _forward.  Session 42 took it from 34
# to 27 (the padding tail and the layout helpers).  PYTHONPATH=. python benchmarks/results/cpu_s42/count_ops.py
import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
from benchmarks.trees import agentic_paths, agentic_specs
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
spec = [s for s in agentic_specs() if s.name == "parallel-tools"][0]
tree = Tree.from_paths(agentic_paths(spec))
b = tree.to_batch(pad_to_multiple=1024)
T = b.seq_len
H, Hkv, D = 16, 8, 1
q = torch.randn(1, T, H, D).transpose(1, 2); k = torch.randn(1, T, Hkv, D).transpose(1, 2); v = torch.randn(1, T, Hkv, D).transpose(1, 2)
vta._fwd = lambda q_t, kg, vg, plan, scale, out=None, lse=None: (out, lse)
class C(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops = []
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func)); return func(*args, **(kwargs or {}))
call = lambda: torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.1, "none")
call()
with C() as m: call()
print(len(m.ops), collections.Counter(m.ops).most_common())
plan = vta._plan(b.subtree_end, q)
with C() as m: vta._forward(q, k, v, plan, 0.1, False)
print(len(m.ops), collections.Counter(m.ops).most_common())
