"""Bad token ids are refused up front, naming the path and position (not an IndexError inside the graph)."""

import re

import numpy as np
import pytest
import torch

from treecompile import Tree
from helpers import cached_compile


@pytest.mark.parametrize("paths, path, got, position", [
    ([[True, False]], 0, "True (bool)", 0),
    ([[1, 2], (3, 4, False)], 1, "False (bool)", 2),
    ([[1, 2.0]], 0, "2.0 (float)", 1),
    ([[1, 2], np.array([True, False])], 1, "(bool", 0),
    ([[1, 2, np.float64(3.0)]], 0, "(float64)", 2),
    ([[1, None]], 0, "None (NoneType)", 1),
    ([[1, 2], iter([3, True])], 1, "True (bool)", 1),  # an iterator: read into a list, then checked
    ([np.array([1, True], dtype=object)], 0, "True (bool)", 1),
    ([[1, torch.tensor(True)]], 0, "tensor(True) (Tensor)", 1),  # array('q') takes it through __index__
    ([[1, torch.tensor([2])]], 0, "tensor([2]) (Tensor)", 1),  # a one-element 1-D tensor is not an id
    ([[1, np.bool_(False)]], 0, "(bool", 1),
], ids=["bool", "bool-in-tuple", "float", "numpy-bool-array", "numpy-float", "none", "iterator-bool",
        "numpy-object-bool", "tensor-bool", "one-element-tensor", "numpy-bool-scalar"])
def test_from_paths_refuses_non_integer_ids(paths, path, got, position):
    with pytest.raises(ValueError, match=rf"^path {path}: token ids must be integers, got .*{re.escape(got)}.* "
                                         rf"at position {position}$"):
        Tree.from_paths(paths)


def test_from_paths_still_takes_integer_kinds():
    t = Tree.from_paths([[1, 2, 3], np.array([1, 2, 4]), torch.tensor([1, 5]), (np.int32(1), np.int64(2))])
    assert t.num_paths == 4 and t.num_tokens == 5
    t = Tree.from_paths([range(1, 4), (x for x in [1, 2, 4]), [1, torch.tensor(5)], np.array([1, 6], dtype=object)])
    assert [t.path(p) for p in range(4)] == [[1, 2, 3], [1, 2, 4], [1, 5], [1, 6]]


@pytest.mark.parametrize("paths, message", [
    ([1, 2, 3], r"^path 0: expected a sequence of token ids, got the number 1 \(paths is a sequence of paths: "
                r"\[\[1, 2, 3\]\] for one path\)$"),
    (torch.tensor([1, 2, 3]), r"^paths: got one 1-D Tensor of token ids; pass a sequence of paths"),
    (np.array([1, 2, 3]), r"^paths: got one 1-D ndarray of token ids"),
    ([[1, 2], [1, 2 ** 63]], r"^path 1: token ids must be non-negative integers below 2\*\*63, got "
                             r"9223372036854775808 at position 1"),
    ([[1, 2, 3], [1, 2, -4, 5]], r"^path 1: token ids must be non-negative integers \(found -4 at position 2\)$"),
], ids=["one-flat-path", "one-tensor", "one-array", "past-int64", "negative"])
def test_from_paths_names_what_is_wrong_with_the_paths(paths, message):
    """A path given where the paths go, and ids that no array of int64 ids can hold, named with their position."""
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(paths)


@pytest.mark.parametrize("weights", [[[1.0, 2.0], [3.0, 4.0]], torch.ones(2, 3)])
def test_path_weights_of_another_shape_are_refused(weights):
    """One number per path: a list of lists of the right length (flattened, it was 4 weights for 2 paths, and
    ``to_batch`` failed inside) is refused naming the shape; ``[P, 1]`` still is one number per path."""
    with pytest.raises(ValueError, match=r"^path_weights: expected one number per path \(2\), got shape \(2, \d\)$"):
        Tree.from_paths([[1, 2], [1, 3]], path_weights=weights)
    t = Tree.from_paths([[1, 2], [1, 3]], path_weights=[[2.0], [3.0]])
    assert t.to_batch().loss_weight.sum() > 0


def test_ids_outside_the_vocabulary_are_named_before_the_graph_runs(tmodel):
    V = tmodel.vocab_size
    assert V == tmodel.model.config.vocab_size
    tmodel(Tree.from_paths([[1, V - 1, 2]]).to_batch())  # the largest id is fine
    with pytest.raises(ValueError, match=rf"^path 2, position 3: token id {V} is outside the model's "
                                         rf"vocabulary \[0, {V}\)"):
        tmodel(Tree.from_paths([[1, 2, 3], [1, 2], [1, 2, 4, V, 5]]).to_batch())
    with pytest.raises(ValueError, match=rf"position 1: token id {V + 7} is outside"):
        tmodel(Tree.from_paths([[3, V + 7]]).to_batch().to("cpu"))


def test_the_check_reads_the_batch_ids_the_graph_reads(tmodel):
    """A batch whose ``input_ids`` were edited after ``to_batch`` (in place, or replaced) is checked on those ids,
    not on its tree's: the graph reads the batch's."""
    import dataclasses

    V = tmodel.vocab_size
    batch = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    edited = dataclasses.replace(batch, input_ids=batch.input_ids.clone())
    edited.input_ids[2] = V + 2
    with pytest.raises(ValueError, match=rf"^path 0, position 2: token id {V + 2} is outside"):
        tmodel(edited)
    with pytest.raises(ValueError, match=rf"token id {V + 2} is outside"):
        tmodel.prepare(edited)
    tmodel(batch)  # the tree's own ids are fine


def test_ids_outside_the_vocabulary_are_named_in_redundancy_free_partitions(tmodel):
    """Partitions run through program.run directly: the executor checks their ids as forward does."""
    from treecompile.runtime.partition import partition_redundancy_free
    from treecompile.runtime.redundancy_free import run_redundancy_free

    V = tmodel.vocab_size
    rf = cached_compile(tmodel.model, boundary=True)
    plan = partition_redundancy_free(Tree.from_paths([[1, 2, 3, 4], [1, 2, 5, V + 3]]), 3)
    with pytest.raises(ValueError, match=rf"^redundancy-free partition \d+: .*token id {V + 3} is outside"):
        run_redundancy_free(rf, plan)


def test_a_partition_batchs_ids_are_checked_from_their_host_values():
    """A batch without its tree (a partition's) checks the host values ``TreeBatch.to`` remembered for its ids, not
    the device tensor (reading that back would wait for the GPU's queue before every partition). A meta tensor
    stands in for the device one here: any read of it would fail."""
    import dataclasses

    from treecompile.host_values import remember_host

    batch = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    for ids, bad in (([1, 2, 3, 4], None), ([1, 2, 3, 99], 3)):
        host = torch.tensor(ids)
        dev = remember_host(torch.empty(4, dtype=torch.long, device="meta"), host)
        part = dataclasses.replace(batch, tree=None, input_ids=dev)
        if bad is None:
            part.check_ids(50)
        else:
            with pytest.raises(ValueError, match=rf"DFS token {bad} of this partition batch: token id 99 is outside"):
                part.check_ids(50)
