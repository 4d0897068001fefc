import json, os, glob, sys
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l)
        print(f.split("/")[-2], {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in (
            "model", "contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "best_baseline",
            "frac_bound", "tree_tokens", "path_tokens", "note", "pid", "grad_cos")})
