"""Tree generators for the benchmark harness (plain Python lists of token ids; no torch).

Two families:

- :func:`synthetic_paths` — the controlled sweep: ``num_paths`` paths of exactly ``path_len`` tokens
  each (so path tokens are fixed), path ``i > 0`` copying a prefix of a random earlier path and then
  diverging with fresh tokens.  The shared prefix lengths are chosen so that the prefix overlap ratio
  ``POR = 1 - unique tokens / path tokens`` hits the requested value (to within one token per path).
  With N paths the largest reachable POR is ``(N-1)(L-1) / (N L)``: 0.92 needs N >= 13.
- :func:`agentic_paths` — trees grown the way agent rollouts branch:
  * **think-mode turns that drop earlier reasoning**: the training sample of turn k is
    ``prompt, (action_j, observation_j for j < k, reasoning dropped), think_k, action_k``; the
    next turn's sample re-serialises turn k without ``think_k``, so consecutive samples diverge
    where ``think_k`` starts;
  * **parallel tool calls**: at ``fanout_turns`` the rollout forks into ``fanout`` branches, one per
    tool call, each with its own call, observation and subsequent turns (sub-agents / group samples);
  * **retokenization drift**: with probability ``drift_prob`` the re-serialised history re-tokenizes
    the last 1-3 tokens of a previous action differently (tokens merging across the chat-template
    boundary), so the next sample diverges a few tokens *before* the dropped reasoning.

``agentic_specs(scale)`` is a fixed suite of specs whose POR spans roughly 0.28-0.89 (the range of
the paper's real trees); ``scale`` multiplies every segment length.

- :func:`group_paths` — a GRPO group: one prompt and its sampled completions (a two-level tree, the most common
  RL batch).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

__all__ = ["synthetic_paths", "max_por", "AgenticSpec", "agentic_paths", "agentic_specs", "group_paths"]


class _Fresh:
    """Token ids drawn at random from [first, vocab) (so that fresh segments never coincide with
    one another except by chance at rate 1/vocab; :func:`_diverge` removes the one case that matters)."""

    def __init__(self, rng: random.Random, vocab: int, first: int = 0):
        if vocab - first < 2:
            raise ValueError(f"vocab: need at least 2 usable token ids, got {vocab - first}")
        self.rng, self.vocab, self.first = rng, vocab, first

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.first, self.vocab) for _ in range(n)]


def _diverge(tok: int, avoid: int, vocab: int, first: int = 0) -> int:
    """``tok``, or the next id if it equals ``avoid`` (a branch must differ at its first token)."""
    if tok != avoid:
        return tok
    return first + (tok - first + 1) % (vocab - first)


def max_por(num_paths: int, path_len: int) -> float:
    """Largest POR :func:`synthetic_paths` can reach: every later path shares all but one token."""
    return (num_paths - 1) * (path_len - 1) / (num_paths * path_len)


def synthetic_paths(num_paths: int, path_len: int, por: float, *, vocab: int = 151_936,
                    seed: int = 0) -> list[list[int]]:
    """``num_paths`` paths of ``path_len`` tokens with prefix overlap ratio ``por``.

    Path 0 is fresh; path i copies the first ``s_i`` tokens of a random earlier path and continues with
    fresh tokens (the first one differing from the copied path's next token), so the unique tokens are
    ``L + sum_i (L - s_i)`` and ``POR = sum_i s_i / (N L)``.  The ``s_i`` are spread uniformly around
    their mean (so branch points vary) and corrected to the exact total.
    """
    if num_paths < 1 or path_len < 1:
        raise ValueError(f"num_paths and path_len must be >= 1, got {num_paths}, {path_len}")
    top = max_por(num_paths, path_len)
    if not 0.0 <= por <= top + 1e-12:
        raise ValueError(f"por: {por} is outside [0, {top:.4f}] for {num_paths} paths of {path_len} tokens")
    rng = random.Random(seed)
    fresh = _Fresh(rng, vocab)
    n = num_paths - 1
    total = round(por * num_paths * path_len)  # sum of shared prefix lengths
    shares = []
    if n:
        mean = total / n
        spread = min(mean, path_len - 1 - mean)  # keep every share inside [0, L-1]
        shares = [int(round(mean + rng.uniform(-spread, spread))) for _ in range(n)]
        shares = [min(max(s, 0), path_len - 1) for s in shares]
        i = 0
        while sum(shares) != total:  # fix the rounding, one token at a time, round robin
            d = 1 if sum(shares) < total else -1
            if 0 <= shares[i % n] + d <= path_len - 1:
                shares[i % n] += d
            i += 1
    paths = [fresh(path_len)]
    for s in shares:
        base = paths[rng.randrange(len(paths))]
        tail = fresh(path_len - s)
        tail[0] = _diverge(tail[0], base[s], vocab)
        paths.append(base[:s] + tail)
    return paths


@dataclass(frozen=True)
class AgenticSpec:
    """One agent rollout tree (segment lengths in tokens; each drawn uniformly in [x/2, 3x/2])."""

    name: str
    prompt: int = 2000  # system prompt + task
    turns: int = 4  # turns per branch, counted from the root
    think: int = 600  # reasoning of a turn (dropped from later turns' history)
    action: int = 150  # the answer / tool call of a turn
    observation: int = 400  # tool result appended after an action
    fanout: int = 1  # branches at each fan-out turn (parallel tool calls / sub-agents)
    fanout_turns: tuple[int, ...] = ()  # turns after which the rollout forks
    drift_prob: float = 0.2  # chance that history re-tokenizes an action's last 1-3 tokens
    vocab: int = 151_936
    seed: int = 0

    def scaled(self, scale: float) -> "AgenticSpec":
        f = lambda x: max(1, int(round(x * scale)))  # noqa: E731
        return dataclasses.replace(self, prompt=f(self.prompt), think=f(self.think), action=f(self.action),
                                   observation=f(self.observation))


def short_node_paths(seed: int, *, root_len: int = 200, branches: int = 12,
                     tails: tuple[int, ...] = (1, 2, 3, 40, 130), vocab: int = 50) -> list[list[int]]:
    """A tree with long and very short (1-3 token) nodes, deep chains and fan-out: a random root path of
    ``root_len`` tokens, then ``branches`` paths that each leave an earlier path at a random token and add a tail
    of one of the ``tails`` lengths (the GDN checks' tree: segments of every size, many plan calls)."""
    rnd = random.Random(seed)
    paths = [[rnd.randrange(vocab) for _ in range(root_len)]]
    for _ in range(branches):
        base = paths[rnd.randrange(len(paths))]
        cut = rnd.randrange(1, len(base))
        paths.append(base[:cut] + [rnd.randrange(vocab) for _ in range(rnd.choice(tails))])
    return paths


def agentic_paths(spec: AgenticSpec) -> list[list[int]]:
    """The training samples (paths) of one rollout tree, see the module docstring."""
    if spec.turns < 1 or spec.fanout < 1:
        raise ValueError(f"{spec.name}: turns and fanout must be >= 1")
    rng = random.Random(spec.seed)
    fresh = _Fresh(rng, spec.vocab)
    draw = lambda x: fresh(max(1, rng.randint(max(1, x // 2), max(1, x * 3 // 2))))  # noqa: E731
    paths: list[list[int]] = []

    def grow(history: list[int], turn: int) -> None:
        """``history``: the re-serialised context before turn ``turn`` (reasoning already dropped)."""
        think, action = draw(spec.think), draw(spec.action)
        paths.append(history + think + action)
        if turn + 1 >= spec.turns:
            return
        branches = spec.fanout if turn in spec.fanout_turns else 1
        for _ in range(branches):
            act = list(action)
            if rng.random() < spec.drift_prob:  # re-tokenized tail of the action in the history
                d = min(len(act), rng.randint(1, 3))
                for j in range(len(act) - d, len(act)):
                    act[j] = _diverge(fresh(1)[0], act[j], spec.vocab)
            # each branch: its own tool call result (a parallel call's observation)
            grow(history + act + draw(spec.observation), turn + 1)

    grow(draw(spec.prompt), 0)
    return paths


def agentic_specs(scale: float = 1.0, names=None) -> list[AgenticSpec]:
    """A fixed suite spanning POR ~0.28-0.89 (low: few turns with long reasoning; high: long prompt,
    many turns with short reasoning and fan-out).  Each spec's ``scale``d segments keep the POR.  ``names``: only
    those, in the suite's order (ValueError naming any the suite lacks)."""
    suite = [
        AgenticSpec("short-chat", prompt=2000, turns=3, think=1800, action=300, observation=200, seed=1),
        AgenticSpec("tool-loop", prompt=1500, turns=5, think=700, action=150, observation=500, seed=2),
        AgenticSpec("parallel-tools", prompt=2500, turns=4, think=400, action=120, observation=600,
                    fanout=3, fanout_turns=(1,), seed=3),
        AgenticSpec("deep-agent", prompt=5000, turns=10, think=200, action=80, observation=250, fanout=2,
                    fanout_turns=(3, 6), seed=4),
    ]
    if names is not None:
        known = [s.name for s in suite]
        if unknown := [n for n in names if n not in known]:
            raise ValueError(f"agentic trees: unknown name(s) {', '.join(map(repr, unknown))}; the suite has "
                             f"{', '.join(known)}")
        suite = [s for s in suite if s.name in names]
    return [s.scaled(scale) for s in suite]


def harness_tree_paths(item: str) -> list[list[int]]:
    """Paths of a harness synthetic tree named ``PATHSxLEN@POR`` (e.g. ``32x2048@0.5``: :func:`synthetic_paths`),
    as ``--harness`` of the attention benchmark and the tile cost model take them."""
    shape, _, por = item.partition("@")
    n, _, length = shape.partition("x")
    try:
        return synthetic_paths(int(n), int(length), float(por))
    except ValueError as e:
        raise ValueError(f"{item!r}: expected PATHSxLEN@POR, e.g. 32x2048@0.5 ({e})") from None


def group_paths(prompt: int = 2048, samples: int = 16, lo: int = 512, hi: int = 1536, *, vocab: int = 151_936,
                seed: int = 0) -> list[list[int]]:
    """A prompt of ``prompt`` tokens and ``samples`` completions of ``lo``-``hi`` tokens (uniform), each with its own
    first token (so the tree is the prompt and ``samples`` children)."""
    if prompt < 0 or samples < 1 or not 1 <= lo <= hi or vocab - samples < 1:
        raise ValueError(f"group: need prompt >= 0, samples >= 1, 1 <= lo <= hi and vocab > samples, got "
                         f"{prompt}, {samples}, {lo}-{hi}, vocab {vocab}")
    rng = random.Random(seed)
    head = _Fresh(rng, vocab, first=samples)(prompt)
    return [head + [i] + _Fresh(rng, vocab)(rng.randint(lo, hi) - 1) for i in range(samples)]
