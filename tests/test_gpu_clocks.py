"""benchmarks.gpu_clocks: the SM clock / power sampler behind ``prof_step --loop``'s clock lines (issue 16)."""

import os
import stat
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.gpu_clocks import GpuClocks, describe, summarize  # noqa: E402


def test_summarize_drops_idle_samples_and_counts_the_unreadable():
    lines = ["1980, 300.0, 40, 0x0000000000000001",  # idle: left out
             "1755, 690.5, 61, 0x0000000000000004",  # software power cap
             "1800, 650.0, 62, 0x0000000000000000",
             "1700, 700.0, 63, 0x0000000000000024",  # power cap and software thermal slowdown
             "[N/A], 650.0, 62, 0x0",  # unreadable clock
             "1750, 6",  # a line cut off when the sampler was stopped
             ""]
    s = summarize(lines)
    assert s["samples"] == 3 and s["idle_samples"] == 1 and s["bad_samples"] == 2
    assert s["sm_mhz"] == 1755 and s["sm_mhz_min"] == 1700 and s["power_w"] == 690.5 and s["temp_c"] == 62
    assert s["capped"]["sw_power_cap"] == pytest.approx(2 / 3, abs=1e-3)
    assert s["capped"]["sw_thermal"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["capped"]["hw_thermal"] == 0


def test_describe_says_the_clock_or_why_there_is_none():
    s = summarize(["1755, 690.5, 61, 0x4", "1700, 650.0, 60, 0x0"])
    assert describe(s) == ("SM clock 1728 MHz (lowest 1700), 670 W, 60 C, samples capped: sw_power_cap 50% "
                           "(2 busy samples)")
    assert "samples capped: none" in describe(summarize(["1755, 690.5, 61, 0x0"]))
    assert describe({"error": "nvidia-smi not found"}) == "clocks not read: nvidia-smi not found"


def test_summarize_without_busy_samples_says_so():
    assert "no busy samples (1 idle, 1 unreadable)" in summarize(["1980, 300, 40, 0x1", "garbage"])["error"]


def test_missing_nvidia_smi_is_an_error_not_numbers(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with GpuClocks() as c:
        pass
    assert c.summary() == {"error": "nvidia-smi not found"}


def _fake_smi(tmp_path, refuse_new_field: bool = False, burst: int = 0, hang: bool = False):
    """A stand-in ``nvidia-smi``: one line for a one-shot query, a line every 20 ms with ``-lms`` (``burst``: that many
    lines at once first); it refuses the new reasons' field name if asked, or never answers (``hang``)."""
    p = tmp_path / "nvidia-smi"
    line = "1755, 690.5, 61, 0x0000000000000004"
    p.write_text("#!/bin/bash\n"
                 + ("sleep 30\n" if hang else "")
                 + ('case "$*" in *clocks_event_reasons*) echo "Field \\"clocks_event_reasons.active\\" is not a '
                    'valid field" >&2; exit 2;; esac\n' if refuse_new_field else "")
                 + 'case "$*" in *-lms*) echo "$*" > "$(dirname "$0")/args";; *) echo "' + line + '"; exit 0;; esac\n'
                 + (f'for i in $(seq {burst}); do echo "{line}"; done\n' if burst else "")
                 + f'while true; do echo "{line}"; sleep 0.02; done\n')
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


@pytest.mark.parametrize("refuse_new_field", [False, True])
def test_sampler_runs_for_the_block_and_falls_back_to_the_old_field_name(tmp_path, refuse_new_field):
    c = GpuClocks("00000000:19:00.0", interval_ms=20, smi=_fake_smi(tmp_path, refuse_new_field))
    for _ in range(2):  # rounds of one kind add up
        with c:
            time.sleep(0.4)
    s = c.summary()
    assert "error" not in s, s
    assert s["samples"] >= 4 and s["sm_mhz"] == 1755 and s["capped"]["sw_power_cap"] == 1.0
    args = (tmp_path / "args").read_text()
    assert "-i 00000000:19:00.0" in args and "-lms 20" in args
    assert ("clocks_throttle_reasons.active" if refuse_new_field else "clocks_event_reasons.active") in args


def test_a_fast_sampler_is_read_whole(tmp_path):
    """The samples go to a file, not a pipe nobody reads while the block runs (a full pipe would stop the sampler):
    a burst of 20,000 lines (about 740 KB) is all there."""
    c = GpuClocks(interval_ms=20, smi=_fake_smi(tmp_path, burst=20000))
    with c:
        time.sleep(1.0)
    assert c.summary()["samples"] >= 20000


def test_a_sampler_is_entered_one_block_at_a_time(tmp_path):
    c = GpuClocks(interval_ms=20, smi=_fake_smi(tmp_path))
    with c:
        with pytest.raises(RuntimeError, match="already sampling"):
            c.__enter__()
        time.sleep(0.3)
    assert c.summary()["samples"] >= 1


def test_an_nvidia_smi_that_does_not_answer_is_an_error(tmp_path):
    with GpuClocks(smi=_fake_smi(tmp_path, hang=True), probe_timeout_s=0.5) as c:
        pass
    assert "no answer in 0.5 s" in c.summary()["error"]


def test_a_refused_query_is_an_error_with_nvidia_smis_words(tmp_path):
    p = tmp_path / "nvidia-smi"
    p.write_text('#!/bin/bash\necho "No devices were found" >&2\nexit 6\n')
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    with GpuClocks(smi=str(p)) as c:
        pass
    assert "rc 6: No devices were found" in c.summary()["error"]
