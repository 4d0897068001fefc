# Session 45: classify a sweep's records (EXACT within 1e-6 or within 10x the reference's own noise, REFUSED at compile,
# HF-FAIL / BUILD-FAIL: HF's own, WRONG?) and list the types whose class differs from session 35's full sweep.
#   python notes/hf_sweep/classify_s45.py notes/hf_sweep/results_s45_full.jsonl
import json, sys


def within_noise(s) -> bool:
    """A comparison record (``worker.compare(..., noise=True)``) within the zoo test's bound: loss and gradients
    within 10x the reference's own rounding noise, log-probs within 1e-6."""
    gn, ln = s.get("noise_grad_rel"), s.get("noise_loss_abs")
    return (gn is not None and s.get("grad_rel", 0) <= 10 * gn + 1e-12 and s["lp_maxdiff"] <= 1e-6
            and abs(s["loss_tree"] - s["loss_ref"]) <= 10 * ln + 1e-12 * abs(s["loss_ref"]))


def classify(r):
    st = r.get("stages", [])
    if not st: return "NO-STAGES"
    by = {s["stage"]: s for s in st}
    if "build" in by and not by["build"].get("ok", True): return "BUILD-FAIL"
    if "ref" in by and not by["ref"].get("ok", True): return "HF-FAIL"
    if "eval_compile" in by and not by["eval_compile"].get("ok"): return "REFUSED"
    worst = "EXACT"
    for name, s in by.items():
        if name.endswith(("_main", "_single", "_onetok")):
            if not s.get("ok"): worst = "RUN-ERROR"; continue
            bad = not (s["loss_rel"] <= 1e-6 and s["lp_maxdiff"] <= 1e-6 and s.get("grad_rel", 0) <= 1e-6)
            if bad and not within_noise(s):
                return "WRONG?"
    if "train_compile" in by and not by["train_compile"].get("ok"): worst = "EXACT(eval; train refused)" if worst == "EXACT" else worst
    return worst
def load(paths):
    out = {}
    for p in paths:
        for l in open(p):
            r = json.loads(l); out[r["model_type"]] = (classify(r), r)
    return out
if __name__ == "__main__":
    new = load(sys.argv[1:])
    old = load(["/work/main/notes/hf_sweep/results_s35_full.jsonl"])
    from collections import Counter
    print(Counter(c for c, _ in new.values()))
    for mt in sorted(new):
        a = new[mt][0]; b = old.get(mt, ("-",))[0]
        if a != b or a.startswith("WRONG") or a == "RUN-ERROR":
            print(f"{mt:28s} s35 {b:28s} now {a}")
