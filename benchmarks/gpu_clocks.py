"""The GPU's SM clock, power draw and clock-event reasons while a benchmark runs (issue 16: is a step's kernel time
set by the clock the GPU holds under load?).

``with GpuClocks() as c: ...`` samples ``nvidia-smi`` every ``interval_ms`` in a child process for the block's
duration; ``c.summary()`` gives the median SM clock (MHz), power (W) and temperature (C), and the share of
samples whose active clock-event reasons include a power or thermal cap.  Where ``nvidia-smi`` is missing or
refuses the query, the summary says why (``{"error": ...}``) instead of numbers: a benchmark row never shows
clocks it did not read.

Samples taken while the GPU was idle (reason bit ``0x1``) are dropped, so a block that ends with a synchronize
reports the clock the work ran at.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

__all__ = ["GpuClocks", "summarize", "describe", "device_id", "CAP_REASONS"]

# nvidia-smi's clocks_event_reasons bits (nvml's nvmlClocksEventReason*): idle, and the caps that lower the clock
IDLE = 0x1
CAP_REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
               "hw_power_brake": 0x80}
FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
# the reasons' field was renamed in recent drivers; the old name is tried when the new one is refused
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def summarize(lines: list[str]) -> dict:
    """``lines``: nvidia-smi's ``--format=csv,noheader,nounits`` rows of ``FIELDS`` + a reasons field.  Rows that do
    not parse (a header, a partial last line, ``[N/A]``) are counted as ``bad`` and left out, never guessed."""
    sm, watts, temp, reasons, bad, idle = [], [], [], [], 0, 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS) + 1:
            bad += line.strip() != ""
            continue
        try:
            c, w, t, r = float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)
        except ValueError:
            bad += 1
            continue
        if r & IDLE:
            idle += 1
            continue
        sm.append(c)
        watts.append(w)
        temp.append(t)
        reasons.append(r)
    if not sm:
        return {"error": f"no busy samples ({idle} idle, {bad} unreadable)"}
    n = len(sm)
    return {"samples": n, "idle_samples": idle, "bad_samples": bad,
            "sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm), "power_w": statistics.median(watts),
            "temp_c": statistics.median(temp),
            "capped": {name: round(sum(bool(r & bit) for r in reasons) / n, 3) for name, bit in CAP_REASONS.items()}}


def describe(summary: dict) -> str:
    """One line of a :func:`summarize` result (or its error) for a benchmark's printout."""
    if "error" in summary:
        return f"clocks not read: {summary['error']}"
    capped = ", ".join(f"{k} {v:.0%}" for k, v in summary["capped"].items() if v) or "none"
    return (f"SM clock {summary['sm_mhz']:.0f} MHz (lowest {summary['sm_mhz_min']:.0f}), {summary['power_w']:.0f} W, "
            f"{summary['temp_c']:.0f} C, samples capped: {capped} ({summary['samples']} busy samples)")


class GpuClocks:
    """Sample the GPU (``device``: an ``nvidia-smi -i`` id, an index or a PCI bus id) every ``interval_ms``.  The
    object may be entered several times, one block at a time (rounds of one kind); :meth:`summary` covers every
    round's samples.  Which name of the reasons' field this driver takes is asked once, at the first entry, by a
    one-shot query run to completion (up to ``probe_timeout_s``); later entries only start the sampling process, so
    a round is not preceded by the GPU idling while a query starts.  The samples go to a temporary file (a pipe
    that nobody reads would stop the sampler once full).  If a later entry cannot start, the summary is that error
    (the earlier rounds' samples are not reported alone)."""

    def __init__(self, device: str | int = 0, interval_ms: int = 50, smi: str | None = None,
                 probe_timeout_s: float = 10.0):
        self.device = str(device)
        self.interval_ms = int(interval_ms)
        self.smi = smi or shutil.which("nvidia-smi")
        self.probe_timeout_s = probe_timeout_s
        self._proc = None
        self._out = None
        self._error = None if self.smi else "nvidia-smi not found"
        self._lines: list[str] = []
        self._field = None

    def _query(self, reason_field: str) -> list[str]:
        return [self.smi, "-i", self.device, f"--query-gpu={','.join(FIELDS + (reason_field,))}",
                "--format=csv,noheader,nounits"]

    def _choose_field(self) -> None:
        """The first reasons' field name a one-shot query accepts, else ``_error`` with nvidia-smi's words."""
        for field in REASON_FIELDS:
            try:
                res = subprocess.run(self._query(field), capture_output=True, text=True,
                                     timeout=self.probe_timeout_s)
            except subprocess.TimeoutExpired:
                self._error = f"nvidia-smi {field}: no answer in {self.probe_timeout_s:g} s"
                return
            if res.returncode == 0:
                self._field, self._error = field, None
                return
            self._error = f"nvidia-smi {field}: rc {res.returncode}: {(res.stderr or res.stdout).strip()[:200]}"

    def __enter__(self):
        if self._proc is not None:
            raise RuntimeError("GpuClocks: already sampling (enter one block at a time)")
        if self._field is None and self._error is None:
            self._choose_field()
        if self._error:
            return self
        self._out = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(self._query(self._field) + ["-lms", str(self.interval_ms)],
                                          stdout=self._out, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self._out.close()
            self._out, self._error = None, f"nvidia-smi: {e}"
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._out.seek(0)
            self._lines.extend(self._out.read().splitlines())
            self._out.close()
            self._proc, self._out = None, None
        return False

    def summary(self) -> dict:
        return {"error": self._error} if self._error else summarize(self._lines)


def device_id(index: int | None = None) -> str:
    """``nvidia-smi -i``'s id for torch's CUDA device ``index`` (None: the current one): its PCI bus id where torch
    reports one (the indices differ under ``CUDA_VISIBLE_DEVICES``), else the index."""
    import torch

    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return str(index)
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
