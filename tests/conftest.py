import gc
import os

# One OpenMP thread per process, set before torch loads: the two xdist workers and every subprocess the tests
# start (CLI runs, saved programs loaded in a fresh process, distributed ranks, the Triton interpreter) would
# otherwise start one per core each on a 2-core machine.  Measured with the README command on an idle 2-core
# machine: 5 min 19 s (user CPU 618 s) -> 4 min 33 s (527 s).  An OMP_NUM_THREADS the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings

# Tiny float64 models: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)

# CI runs the same hypothesis examples every time (a failure there reproduces locally with CI=1);
# local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Every varlen segment plan a test builds, here and in the processes the tests start, is proven to be the tree mask
# (off by default at run time: the nesting check is what the batch needs; this checks the layout code,
# ops/varlen_tree_attention.py's VERIFY_PLANS).
os.environ["TREECOMPILE_VERIFY_PLANS"] = "1"  # read when the module is imported, after this file

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]


@pytest.fixture(scope="module")
def model():
    """The tiny dense reference model in float64 (one per test module: its own copy, pristine weights)."""
    from helpers import cached_model, tiny_dense

    return cached_model("dense-tiny", tiny_dense)


@pytest.fixture(scope="module")
def tmodel(model):
    """``treecompile.compile(model)``; captured once per process (``helpers.cached_compile``)."""
    from helpers import cached_compile

    return cached_compile(model)


# `pytest -n 2 --dist loadfile` hands whole files to the two workers in collection order, the next file
# to whichever worker is nearly done: every file, longest first (worker seconds measured with --durations
# on 2 cores), so that the workers finish together instead of one running a heavy file alone at the
# end.  A file not listed runs after these; order inside a file is unchanged.
HEAVIEST_FIRST = ["test_compile_hybrid.py", "test_saved.py", "test_flex_tree_attention_boundary.py",
                  "test_compile_zoo.py", "test_distributed.py", "test_train.py", "test_redundancy_free.py",
                  "test_router_loss.py", "test_cli.py", "test_compile.py", "test_rewrite_mixers.py",
                  "test_router_partitions.py", "test_verify_token_locality.py", "test_cuda_lowering.py",
                  "test_partition.py", "test_objectives.py", "test_tree.py", "test_tree_gdn.py", "test_entropy.py",
                  "test_split_modules.py", "test_fa4_tree_attention.py", "test_objectives_modes.py",
                  "test_tracing.py", "test_hybrid_model.py", "test_readme.py", "test_hybrid_baselines.py",
                  "test_tree_layout.py", "test_fla_plan.py", "test_bench_trees.py", "test_flex_tree_attention.py",
                  "test_dense_tree_attention.py", "test_gdn.py", "test_data.py", "test_input_checks.py",
                  "test_logprobs.py", "test_fla_gdn.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


def pytest_collection_finish(session):
    # Everything imported and built during collection (torch, transformers, sympy, the test modules) lives
    # to the end: move it out of the cyclic garbage collector's view, so that its full collections during
    # the run and pytest's five at the end (unraisable-exception check) walk only what the tests made.
    # Reference counting still frees these objects; only cycles among them are never collected.
    gc.freeze()


def pytest_configure(config):
    # pytest-xdist (3.x) reorders --dist loadfile/loadscope scopes by their number of tests unless told
    # not to, which would override HEAVIEST_FIRST: keep the collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
