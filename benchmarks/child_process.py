"""Run one benchmark command in a child process: its output forwarded, a time limit, and how it ended.

The harness's ``--isolate`` mode (:mod:`benchmarks.harness`) times every contender in a fresh process,
so that none pays for the allocator state, compile caches or fragmentation another left behind.  This
module only starts, watches and ends such a child; what the child computes is the harness's business.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildExit:
    """How a child ended: ``returncode`` (negative: killed by that signal; None: timed out and killed),
    the last non-empty line it wrote to stderr, its pid."""

    returncode: int | None
    last_stderr: str
    pid: int
    timeout_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """``child exited 3: <last stderr line>``, ``child exited -9 (SIGKILL): ...`` or
        ``child timed out after N s``."""
        if self.returncode is None:
            return f"child timed out after {self.timeout_s:g} s"
        code = str(self.returncode)
        if self.returncode < 0:
            try:
                code += f" ({signal.Signals(-self.returncode).name})"
            except ValueError:
                pass
        return f"child exited {code}: {self.last_stderr[:160]}" if self.last_stderr else f"child exited {code}"


def run_child(cmd: list[str], *, timeout_s: float, prefix: str = "", env: dict | None = None) -> ChildExit:
    """Run ``cmd`` in a new session; forward its stdout and stderr, each line after ``prefix``, to this
    process's stderr (the parent's stdout stays its own); after ``timeout_s`` kill its whole process group
    (a child's compile workers included).  Never raises for what the child does."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", env=env, start_new_session=True,
                            preexec_fn=_die_with_parent())
    tail: collections.deque[str] = collections.deque(maxlen=1)

    def pump(src, keep: bool):
        for line in src:
            sys.stderr.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            if keep and line.strip():
                tail.append(line.strip())
        src.close()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, False), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, True), daemon=True)]
    for t in pumps:
        t.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # a timeout, or the parent interrupted: end the child and whatever it started
        if proc.poll() is None:
            _kill_group(proc)
    for t in pumps:
        t.join(timeout=10)  # a grandchild still holding the pipes must not hang the parent
    sys.stderr.flush()
    return ChildExit(rc, tail[0] if tail else "", proc.pid, timeout_s)


def _die_with_parent():
    """Linux: a ``preexec_fn`` that has the kernel SIGKILL the child when this process dies (the child leads
    its own session, so a signal sent to this process's group, e.g. by a time limit, would not reach it).
    ``prctl`` is looked up here, before the fork: the forked child only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: its group id is its pid
    except ProcessLookupError:
        pass
    proc.wait()
