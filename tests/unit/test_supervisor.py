"""The launcher's supervision: signals reach SGLang, its exit status is ours, and no child outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from pdcluster.worker.supervisor import Supervisor

# Stands in for SGLang's launch_server: a main process with a child that ignores SIGTERM (like a stuck scheduler).
FAKE_SERVER = textwrap.dedent("""
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    print(child.pid, flush=True)  # only once the handler is in place: the test signals as soon as it reads this
    time.sleep(600)
""")

LAUNCHER = textwrap.dedent(f"""
    import sys
    from pdcluster.worker.supervisor import Supervisor
    sys.exit(Supervisor([sys.executable, "-c", {FAKE_SERVER!r}], env=None).run())
""")


def test_sigterm_is_forwarded_status_is_kept_and_no_orphan_survives():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
    grandchild = int(launcher.stdout.readline())
    server = psutil.Process(launcher.pid).children()[0].pid
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) == 3  # the fake server's own exit status
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (psutil.pid_exists(grandchild) or psutil.pid_exists(server)):
        time.sleep(0.05)
    alive = [p for p in (server, grandchild) if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []


def test_killed_child_maps_to_128_plus_signal():
    code = Supervisor([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], None).run()
    assert code == 128 + signal.SIGKILL
