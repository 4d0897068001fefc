import sys, torch
sys.path.insert(0, "benchmarks")
from benchmarks import harness as h
from benchmarks.flops import FlopModel, path_attention_entries, tree_attention_entries
from treecompile import Tree
for name, n in [("qwen3-4b", 16), ("qwen3-4b", 32), ("qwen3-0.6b", 32)]:
    spec = h.model_specs()[name]
    with torch.device("meta"):
        model = spec.build("meta", torch.bfloat16)
    case = h.synthetic_cases([0.5], n, 2048, spec.config.vocab_size)[0]
    fm = FlopModel.of(model)
    lens = [len(p) for p in case.paths]
    base = fm.train(sum(lens), lambda w: path_attention_entries(lens, w))
    t = Tree.from_paths([list(p) for p in case.paths])
    tr = fm.train(t.num_tokens, lambda w: tree_attention_entries(t.depth, w))
    print(name, n, t.num_tokens, round(base / tr, 4))
