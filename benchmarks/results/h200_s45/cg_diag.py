"""Why the CUDA graphs' GPU test fails (session 45): run it as is and copy the generated inductor modules its
traceback passes through into $OUT/code; then run it again with inductor's slow-path pool assertion off, to see
whether the results then agree with the plain compiled model (a false alarm) or not."""
import os
import shutil
import sys
import traceback

import torch

sys.path.insert(0, "tests")
import test_varlen_tree_attention as t  # noqa: E402

out = os.environ["OUT"]
for asserts in (True, False):
    torch._dynamo.reset()
    torch._inductor.config.triton.slow_path_cudagraph_asserts = asserts
    try:
        t.test_cudagraphs_contender_replays_without_stale_host_work()
        print(f"slow_path_cudagraph_asserts={asserts}: PASSED", flush=True)
    except BaseException as e:  # noqa: BLE001
        print(f"slow_path_cudagraph_asserts={asserts}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        tb = traceback.extract_tb(e.__traceback__)
        print("".join(traceback.format_list(tb[-12:])))
        os.makedirs(f"{out}/code", exist_ok=True)
        for fr in tb:
            if "inductor" in fr.filename and fr.filename.startswith("/tmp/"):
                shutil.copy(fr.filename, f"{out}/code/{asserts}_{os.path.basename(fr.filename)}")
