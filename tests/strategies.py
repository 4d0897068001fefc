"""hypothesis strategies for trajectory trees, odd shapes included."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def path_sets(draw, max_paths: int = 12, max_len: int = 12, vocab: int = 4):
    """Paths grown from earlier ones, so that prefixes are shared, plus duplicates and prefixes."""
    n = draw(st.integers(1, max_paths))
    paths: list[list[int]] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["fresh", "branch", "branch", "duplicate", "prefix"]))
        if not paths or kind == "fresh":
            p = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_len))
        else:
            base = draw(st.sampled_from(paths))
            if kind == "duplicate":
                p = list(base)
            elif kind == "prefix":
                p = base[: draw(st.integers(1, len(base)))]
            else:
                keep = draw(st.integers(0, len(base)))
                tail = draw(st.lists(st.integers(0, vocab - 1), min_size=1 if keep == 0 else 0,
                                     max_size=max_len))
                p = base[:keep] + tail
                if not p:
                    p = [0]
        paths.append(p)
    return paths


@st.composite
def weighted_path_sets(draw, **kw):
    paths = draw(path_sets(**kw))
    masks = [[0] + [draw(st.integers(0, 1)) for _ in p[1:]] for p in paths]
    weights = [draw(st.floats(-2, 2, allow_nan=False, allow_infinity=False)) for _ in paths]
    return paths, masks, weights


ODD_TREES = {
    "single_path": [[5, 6, 7, 8, 9]],
    "single_token": [[3]],
    "duplicates": [[1, 2, 3], [1, 2, 3], [1, 2, 3]],
    "prefix_of_other": [[1, 2], [1, 2, 3, 4], [1]],
    "one_token_nodes": [[1, 2, 3, 4], [1, 5, 6, 7], [1, 5, 8, 9], [1, 5, 8, 2]],
    "wide_fanout_64": [[7, 7, 7] + [i % 60 + 1, i] for i in range(64)],
    "forest": [[1, 2], [3, 4], [1, 5]],
    "deep_chain": [list(range(1, k + 1)) for k in range(1, 10)],
}
