"""benchmarks/qwen_coder_vllm.py's CPU accounting: where a level's CPU time went (the server, the
bench client, other jobs), so a level that ran beside another job shows it."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from qwen_coder_vllm import busy_seconds, cpu_reading, cpu_shares, group_cpu_seconds  # noqa: E402


def test_busy_seconds_counts_every_busy_field_and_no_idle():
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  100 20 30 5000 70 4 6 10 0 0\n"
    assert busy_seconds(line, 100) == (100 + 20 + 30 + 4 + 6 + 10) / 100


def test_cpu_shares_puts_the_rest_of_the_machine_in_other():
    before = {"wall": 10.0, "machine": 100.0, "server": 40.0, "client": 1.0}
    after = {"wall": 20.0, "machine": 125.0, "server": 55.0, "client": 2.0}
    assert cpu_shares(before, after) == {"wall_s": 10.0, "server_cpu_s": 15.0, "client_cpu_s": 1.0,
                                         "other_cpu_s": 9.0}
    # the clock ticks of /proc/stat and the processes' own can disagree by a tick: never negative
    after["machine"] = 115.0
    assert cpu_shares(before, after)["other_cpu_s"] == 0.0


def test_group_cpu_seconds_includes_this_process():
    if not Path("/proc/self/stat").exists():
        return
    hz = os.sysconf("SC_CLK_TCK")
    t = time.process_time()
    while time.process_time() - t < 0.2:  # burn CPU so that this process has ticks to count
        pass
    mine = os.times()
    assert group_cpu_seconds(os.getpgrp(), hz) >= mine.user + mine.system - 2 / hz
    assert group_cpu_seconds(-12345, hz) == 0.0  # no such group
    r = cpu_reading(os.getpgrp())
    assert set(r) == {"wall", "machine", "server", "client"} and r["server"] > 0
