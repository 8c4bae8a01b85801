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
    # Process objects, not bare pids: is_running() also checks the creation time, so a pid the busy machine gives
    # to some new process meanwhile is not taken for a survivor.
    grandchild = psutil.Process(int(launcher.stdout.readline()))
    server = psutil.Process(launcher.pid).children()[0]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 3  # the fake server's own exit status

    def survivors() -> list[int]:
        alive = []
        for p in (server, grandchild):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.monotonic() + 30  # the group is killed as the launcher exits; a busy machine may lag a little
    while time.monotonic() < deadline and survivors():
        time.sleep(0.05)
    assert survivors() == []


def test_killed_child_maps_to_128_plus_signal():
    code = Supervisor([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], None).run()
    assert code == 128 + signal.SIGKILL
