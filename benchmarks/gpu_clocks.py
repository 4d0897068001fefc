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

__all__ = ["GpuClocks", "summarize", "CAP_REASONS"]

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


class GpuClocks:
    """Sample the GPU (``device``: an ``nvidia-smi -i`` id, an index or a PCI bus id) every ``interval_ms``.  The
    object may be entered several times (rounds of one kind); :meth:`summary` covers every round's samples."""

    def __init__(self, device: str | int = 0, interval_ms: int = 50, smi: str | None = None):
        self.device = str(device)
        self.interval_ms = int(interval_ms)
        self.smi = smi or shutil.which("nvidia-smi")
        self._proc = None
        self._error = None if self.smi else "nvidia-smi not found"
        self._lines: list[str] = []
        self._field = None

    def _start(self, reason_field: str):
        cmd = [self.smi, "-i", self.device, f"--query-gpu={','.join(FIELDS + (reason_field,))}",
               "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self):
        if self._error:
            return self
        fields = REASON_FIELDS if self._field is None else (self._field,)
        for field in fields:
            proc = self._start(field)
            try:  # a refused query exits at once; a running one is still there after 0.3 s
                proc.wait(timeout=0.3)
            except subprocess.TimeoutExpired:
                self._proc, self._field, self._error = proc, field, None
                return self
            out, err = proc.communicate()
            self._error = f"nvidia-smi {field}: rc {proc.returncode}: {(err or out).strip()[:200]}"
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate()
            self._lines.extend(out.splitlines())
            self._proc = None
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
