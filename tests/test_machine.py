"""The oversubscription warning: other busy metasd processes + this one's torch threads vs the cores."""
import subprocess
import sys
import time

import pytest

from metasd.models import machine
from metasd.models.machine import BusyProcess, busy_metasd_processes, oversubscription_warning


def test_warning_text_names_the_fix():
    others = [BusyProcess(41, 1.9, "metasd bench experiments/smoke.yaml")]
    msg = oversubscription_warning(2, others, cores=2)
    assert "1 other busy metasd process(es) use 1.9 of this machine's 2 cores" in msg and "--threads 1" in msg
    assert "pid 41" in msg
    assert oversubscription_warning(2, [], cores=2) is None  # alone: fine
    assert oversubscription_warning(1, [BusyProcess(1, 0.9, "metasd x")], cores=2) is None  # 1 + 0.9 <= 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_real_busy_metasd_process_is_found_and_warned_about_once(monkeypatch, capsys):
    # a busy loop whose command line says metasd, as `metasd bench ...` would
    busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.time()\nwhile time.time() - t < 20: pass",
                             "metasd-busy-test"])
    try:
        time.sleep(0.5)
        # a low bar: under `pytest -n 2` on 2 cores the busy loop shares them with both workers (~0.6 core each)
        found = [p for p in busy_metasd_processes(interval=0.5, min_busy=0.2) if p.pid == busy.pid]
        assert found and found[0].cores > 0.2 and "metasd-busy-test" in found[0].command
        # the warning from what was found (a second measurement could see the loop starved below min_busy)
        monkeypatch.setattr(machine, "busy_metasd_processes", lambda: found)
        monkeypatch.setattr(machine, "_warned", False)
        msg = machine.warn_if_oversubscribed(threads=2, cores=1)  # over whatever share the loop got
        assert msg and "--threads" in capsys.readouterr().err
        assert machine.warn_if_oversubscribed(threads=2, cores=1) is None  # once per process
    finally:
        busy.kill()
        busy.wait()
    idle = [p for p in busy_metasd_processes(interval=0.2) if p.pid == busy.pid]
    assert not idle
