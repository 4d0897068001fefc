"""Sweep every MODEL_FOR_CAUSAL_LM_MAPPING_NAMES type through treecompile (one subprocess per type, 120 s limit).

usage: python sweep.py [model_type ...]    -> appends to results.jsonl; then python report.py -> RESULTS.md
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, "/work/main")
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 120
# multimodal-only (the text-only causal LM of the family has its own *_text entry) or remote code
SKIP = {
    "gemma3": "multimodal-only ForConditionalGeneration (text part swept as gemma3_text)",
    "gemma3n": "multimodal-only ForConditionalGeneration (text part swept as gemma3n_text)",
    "gemma4": "multimodal-only ForConditionalGeneration (text part swept as gemma4_text)",
    "gemma4_unified": "multimodal-only ForConditionalGeneration (text part swept as gemma4_unified_text)",
    "got_ocr2": "multimodal-only (OCR) ForConditionalGeneration",
    "moss_transcribe_diarize": "audio multimodal ForConditionalGeneration",
    "fuyu": "multimodal (image patches); default-size vision parts: the worker was OOM-killed (rc -9) in the first pass",
    "phi4_multimodal": "multimodal (vision+audio embedders at default size): OOM-killed (rc -9) after compiling in the first pass",
    "blt": "byte latent transformer (patcher + local encoder/decoder sub-configs): > 120 s at build/default sub-config sizes",
}
# per-model config extras (JSON-able), e.g. layer_types to get a mix of layer kinds in 2 layers
EXTRA = json.load(open(os.path.join(HERE, "extra.json"))) if os.path.exists(os.path.join(HERE, "extra.json")) else {}


def run_one(mt):
    rec = {"model_type": mt, "cls": MAPPING[mt]}
    if mt in SKIP:
        rec["skip"] = SKIP[mt]
        return rec
    cmd = [sys.executable, os.path.join(HERE, "worker.py"), mt]
    if mt in EXTRA:
        cmd.append(json.dumps(EXTRA[mt]))
    env = dict(os.environ, PYTHONPATH="/work/main", OMP_NUM_THREADS="2")
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc, rec["timeout"] = None, TIMEOUT
    rec["wall"] = time.time() - t
    rec["rc"] = rc
    rec["stages"] = [json.loads(l[2:]) for l in out.splitlines() if l.startswith("@@")]
    if rc not in (0, None):
        rec["stderr_tail"] = err[-1500:]
    return rec


def main():
    todo = sys.argv[1:] or list(MAPPING)
    path = os.path.join(HERE, "results.jsonl")
    for mt in todo:
        rec = run_one(mt)
        with open(path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        st = {s["stage"]: s.get("ok") for s in rec.get("stages", [])}
        print(f"{mt:28s} {rec.get('wall', 0):6.1f}s rc={rec.get('rc')} {rec.get('skip', '')} {st}", flush=True)


if __name__ == "__main__":
    main()
