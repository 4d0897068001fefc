"""Print the rows of every harness run under $OUT (results.jsonl when the tree finished, else the log's rows)."""
import glob, json, os
KEYS = ("model", "contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "best_baseline",
        "frac_bound", "tree_tokens", "path_tokens", "loss_rel_dev", "grad_cos", "note")
for log in sorted(glob.glob(os.environ["OUT"] + "/*_log.txt")):
    for line in open(log):
        if line.startswith('{"model"'):
            r = json.loads(line)
            row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in KEYS}
            print(os.path.basename(log), row)
for f in sorted(glob.glob(os.environ["OUT"] + "/*/tables.md")):
    print(f); print(open(f).read()[:3000])
