# session 23: the MoE hybrid (HF Qwen3.5-MoE, qwen3.5-35b-a3b-8l) end to end on one H100
#   bash d.sh smoke      transformers on the device: the spec's config, GDN hook discovery, FLOP model (meta device)
#   bash d.sh e2e        session 20's b.sh with MODEL (default qwen3.5-35b-a3b-8l), SUITE, PATHS, CONTENDERS, T, CT
source benchmarks/results/h100_s18/pre.sh
case "$1" in
smoke)
  python - <<'PY' 2>&1 | grep -v -i "warn" | tee $OUT/smoke.txt
import torch, transformers
from benchmarks import harness
from benchmarks.flops import FlopModel
from treecompile.frontend import gdn_hook_owners as gdn_hooks
cfg = harness.model_specs()["qwen3.5-35b-a3b-8l"].config.build()
with torch.device("meta"):
    m = transformers.AutoModelForCausalLM.from_config(cfg)
print(type(m).__name__, cfg.layer_types, sum(p.numel() for p in m.parameters()) / 1e9)
print("hooks:", [(getattr(o, "__name__", type(o).__name__), g, c) for o, g, c in gdn_hooks(m)])
print("norms:", sorted({type(x).__name__ for x in m.modules() if "Norm" in type(x).__name__}))
print(FlopModel.of(m))
PY
  ;;
*) MODEL=${MODEL:-qwen3.5-35b-a3b-8l} bash benchmarks/results/h100_s20/b.sh ;;
esac
