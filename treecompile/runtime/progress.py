"""The one progress bar of treecompile: a single stderr line, no dependency.

Used by ``train_step(progress=True)`` (batches and tokens) and by the JSONL reader behind
``treecompile stats`` (bytes read).  It draws only when ``enabled`` (callers pass "stderr is a
terminal and the work is large"), redraws at most every ``interval`` seconds, and ``close()`` clears
the line so that later output starts clean.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``label [#####.....] 50% done/total unit[, tokens] elapsed``.

    ``total``: units of work (batches, bytes); ``update(tokens=0, advance=1)`` counts ``advance``
    more units done and ``tokens`` more tokens (shown when any were counted).  ``done`` and
    ``tokens`` are plain attributes.
    """

    def __init__(self, total: int, label: str, *, enabled: bool, unit: str = "", width: int = 30,
                 interval: float = 0.1, stream=None):
        self.total, self.label, self.enabled, self.unit, self.width = max(int(total), 1), label, enabled, unit, width
        self.interval = interval
        self.stream = stream
        self.done = self.tokens = 0
        self.t0 = time.perf_counter()
        self._last_draw: float | None = None
        self._drawn = 0  # length of the last line drawn (0: nothing to clear)

    def update(self, tokens: int = 0, *, advance: int = 1) -> None:
        self.done += advance
        self.tokens += tokens
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._last_draw is not None and now - self._last_draw < self.interval and self.done < self.total:
            return
        self._last_draw = now
        frac = min(1.0, self.done / self.total)
        fill = int(self.width * frac)
        text = (f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {int(100 * frac):3d}% "
                f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''}"
                f"{f', {self.tokens} tokens' if self.tokens else ''}, {now - self.t0:.1f}s")
        out = self.stream or sys.stderr
        out.write("\r" + text + " " * max(0, self._drawn - len(text)))
        out.flush()
        self._drawn = len(text)

    def close(self) -> None:
        if self.enabled and self._drawn:
            out = self.stream or sys.stderr
            out.write("\r" + " " * self._drawn + "\r")
            out.flush()
            self._drawn = 0
