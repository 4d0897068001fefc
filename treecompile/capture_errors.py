"""One line for a model that torch.export refuses: which construct of the model's code broke the capture.

torch.export answers a model that cannot run at every sequence length with "Constraints violated
(seq)" and the guard it derived ("specialized it to be a constant (16)", "... satisfy the generated
guard seq <= 2048"), but not the line of the model's code that set the guard.  That line is known
while the guard is added: torch logs it (``torch.fx.experimental.symbolic_shapes``, "[guard
added]").  :func:`record_guards` listens to that log during a capture and keeps, per guard, the
innermost frame of the caller's code (not torch, not the Python library, not treecompile's own
capture code); :func:`explain_capture_error` turns a ``CaptureError`` plus those guards into one line:

    MambaForCausalLM: torch.export cannot capture it at every sequence length: the code fixes the
    length to the example's 16 tokens at modeling_mamba.py:260 in slow_forward (`for index in
    range(seq_len):`), a Python loop or branch over the length (e.g. a recurrent scan) ...

Used by :func:`treecompile.frontend.capture` around ``torch.export.export``, so that
``treecompile.compile`` (from Python or ``treecompile rewrite``) raises a ``CaptureError`` with that line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass

__all__ = ["Guard", "record_guards", "explain_capture_error"]

_LOGGER = "torch.fx.experimental.symbolic_shapes"


@dataclass(frozen=True)
class Guard:
    """A guard torch.export added on a symbolic size, and the user code that added it."""

    expr: str  # e.g. "Eq(s70, 16)", "s70 <= 2048"
    where: str  # "modeling_mamba.py:260 in slow_forward" ("" when no user frame was found)
    code: str  # the source line, stripped ("" when unknown)


def _skipped_dirs() -> tuple[str, ...]:
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.abspath(logging.__file__))]
    return tuple(os.path.join(d, "") for d in dirs) + tuple(
        os.path.join(here, f) for f in ("frontend.py", "compile.py", "capture_errors.py", "cli.py"))


def _user_frame(skip: tuple[str, ...]) -> traceback.FrameSummary | None:
    paths = sysconfig.get_paths()
    stdlib = os.path.join(paths["stdlib"], "")
    packages = tuple(os.path.join(paths[k], "") for k in ("purelib", "platlib"))
    for fs in reversed(traceback.extract_stack()):
        path = os.path.abspath(fs.filename)
        library = path.startswith(stdlib) and not path.startswith(packages)  # the Python library itself
        if not (library or path.startswith(skip) or fs.filename.startswith("<")):
            return fs
    return None


class _Listener(logging.Handler):
    def __init__(self, guards: list[Guard]):
        super().__init__(logging.INFO)
        self.guards, self.skip = guards, _skipped_dirs()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if "[guard added]" not in str(record.msg) or "[guard suppressed]" in record.getMessage():
                return
            args = record.args if isinstance(record.args, tuple) else ()
            expr = str(args[1]) if len(args) > 1 else record.getMessage()
            fs = _user_frame(self.skip)
            where = f"{os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}" if fs else ""
            self.guards.append(Guard(expr=expr, where=where, code=(fs.line or "").strip() if fs else ""))
        except Exception:  # a diagnostic aid: never let it break the capture
            pass


def _drop_unfound_user_code(record: logging.LogRecord) -> bool:
    """torch's "Unable to find user code corresponding to {u0}" warning (with a dump of the graph) on a
    data-dependent value: :func:`explain_capture_error` names the model's line itself, in one line."""
    return not str(record.msg).startswith("Unable to find user code")


@contextlib.contextmanager
def record_guards():
    """Collect the guards added on symbolic sizes while the block runs (a list, filled in place);
    torch's own log output is unchanged but for its graph dump on a data-dependent value
    (:func:`_drop_unfound_user_code`)."""
    guards: list[Guard] = []
    log = logging.getLogger(_LOGGER)
    handler = _Listener(guards)
    level, propagate, effective = log.level, log.propagate, log.getEffectiveLevel()
    others = [(h, h.level) for h in log.handlers]
    if effective > logging.INFO:  # the level is lowered for us only: torch's handlers keep printing what they did
        for h, lv in others:
            h.setLevel(max(lv, effective))
        log.propagate = False
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.addFilter(_drop_unfound_user_code)
    try:
        yield guards
    finally:
        log.removeFilter(_drop_unfound_user_code)
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        for h, lv in others:
            h.setLevel(lv)


def _at(g: Guard | None) -> str:
    if g is None or not g.where:
        return ""
    return f" at {g.where}" + (f" (`{g.code}`)" if g.code else "")


def explain_capture_error(err: BaseException, guards: list[Guard] | tuple = ()) -> str:
    """One line for a capture failure: what torch.export refused and, when the guards tell, the
    model's source line that made the sequence length static or bounded."""
    head = " ".join(str(err).split())
    cause = err.__cause__
    text = str(cause) if cause is not None else str(err)
    model = head.split("capture ", 1)[1].split(" ", 1)[0] if "could not capture " in head else "the model"
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in text:
        call = re.search(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in (\S+)\n'
                         r'(?:[ \t]+(\S[^\n]*))?', text)
        code = f" (`{call.group(4).strip()}`)" if call and call.group(4) else ""
        at = f" at {call.group(1)}:{call.group(2)} in {call.group(3)}{code}" if call else ""
        return (f"{model}: torch.export cannot capture it{at}: the code turns a tensor's value into a Python number "
                f"or branch (int(t), t.item(), `if t:`, a size read from data), which a captured program cannot keep "
                f"for every input; compute it from shapes or Python constants instead ({head.split(': ', 2)[-1]})")
    if "Constraints violated" not in text:
        return head
    const = re.search(r"specialized it to be a constant \((\d+)\)", text)
    if const:
        n = const.group(1)
        g = next((g for g in guards if re.fullmatch(rf"Eq\(\w+, {n}\)|Eq\({n}, \w+\)", g.expr)), None)
        return (f"{model}: torch.export cannot capture it at every sequence length: the code fixes the length "
                f"to the example's {n} tokens{_at(g)}, a Python loop or branch over the length (e.g. a "
                f"recurrent scan written as a loop); treecompile serialises a tree as one sequence of any "
                f"length, so this model is not supported as written")
    bound = re.search(r"satisfy the generated guard ([^\n]*?)\.?\n", text + "\n")
    if bound:
        nums = re.findall(r"\b(\d{2,})\b", bound.group(1))

        def compares(g):  # a bound on a size: sympy writes it either way round (`s0 < 9`, `s27 > 8`)
            return "<" in g.expr or ">" in g.expr

        g = next((g for g in guards if compares(g) and any(n in g.expr for n in nums)), None)
        g = g or next((g for g in guards if compares(g) or "Ne(" in g.expr), None)
        limit = f" (guard {g.expr})" if g else ""
        said = bound.group(1).strip()
        lower = [int(n) for n in re.findall(r"(?<![\w.\]])(\d+) <= L\[", said)]
        upper = [int(n) for n in re.findall(r"<= (\d+)(?![\w\[])", said)]
        if any(n > 2 for n in lower) and not any(n < (1 << 20) for n in upper):
            what = (f"the code needs at least {max(lower)} tokens{limit}{_at(g)} (e.g. a window or unfold of "
                    f"that size, or a branch on the length), and a tree batch may be shorter")
        elif g is not None and g.expr.startswith("Ne(") and not any(n < (1 << 20) for n in upper):
            what = (f"the code behaves differently at some particular length{limit}{_at(g)} (a guard that a size "
                    f"derived from the length is not some value, e.g. a concatenation or broadcast that a length of "
                    f"1 or 2 would change); a tree serialised as one sequence may have any length")
        else:
            what = (f"the code bounds the length{limit}{_at(g)}, e.g. a fixed-size position table or "
                    f"attention-mask buffer; a tree serialised as one sequence may be longer")
        return f"{model}: torch.export cannot capture it at every sequence length: {what}: refused (torch: {said})"
    first = next((line.strip() for line in text.splitlines()[1:] if line.strip().startswith("- ")), "")
    return f"{head} {first}".strip()
