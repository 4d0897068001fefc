"""prof_step with the batch's host values switched off (NO_HOST_VALUES=1): every plan then reads the tree
tensors back from the GPU, as before session 24 (the A/B of `treecompile.host_values`)."""
import os
import sys

sys.path.insert(0, os.getcwd())
if os.environ.get("NO_HOST_VALUES") == "1":
    import treecompile.host_values as hv
    import treecompile.tree as tr

    hv.remembered_host = tr.remembered_host = lambda t: None
    print("host values: off", flush=True)
from benchmarks import prof_step  # noqa: E402

sys.exit(prof_step.main(sys.argv[1:]))
