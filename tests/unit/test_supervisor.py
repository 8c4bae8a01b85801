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


# An SGLang that drains: on SIGTERM it says so, then needs DRAIN seconds before it exits.
DRAINING_SERVER = textwrap.dedent("""
    import signal, sys, time
    def drain(*_):
        print("draining", flush=True)
        time.sleep(float(sys.argv[1]))
        sys.exit(0)
    signal.signal(signal.SIGTERM, drain)
    print("up", flush=True)
    time.sleep(600)
""")

GRACEFUL_LAUNCHER = textwrap.dedent(f"""
    import sys
    from pdcluster.worker.supervisor import Supervisor
    on_stop = lambda: print("left the pools", flush=True)
    cmd = [sys.executable, "-c", {DRAINING_SERVER!r}, sys.argv[2]]
    sys.exit(Supervisor(cmd, env=None, grace_period=float(sys.argv[1]), on_stop=on_stop).run())
""")


def graceful_stop(grace: float, drain: float) -> tuple[list[str], int]:
    launcher = subprocess.Popen([sys.executable, "-c", GRACEFUL_LAUNCHER, str(grace), str(drain)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = [launcher.stdout.readline().strip()]  # "up"
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=120)
    return lines + [line.strip() for line in launcher.stdout.readlines()], code


def test_a_stop_leaves_the_pools_first_then_sglang_drains_within_the_grace_period():
    lines, code = graceful_stop(grace=20, drain=3)  # 3 s of draining fit in 20 - STOP_MARGIN
    assert lines == ["up", "left the pools", "draining"] and code == 0


def test_a_drain_longer_than_the_grace_period_is_cut():
    started = time.monotonic()
    lines, code = graceful_stop(grace=15, drain=60)  # SGLang gets 15 - STOP_MARGIN = 5 s, then SIGKILL
    assert lines == ["up", "left the pools", "draining"] and code == 128 + signal.SIGKILL
    assert time.monotonic() - started < 40


# Stands in for SGLang with --enable-metrics: what its HTTP process would see at prometheus_client's first import.
METRICS_SERVER = "import os, sys; d = os.environ.get('PROMETHEUS_MULTIPROC_DIR'); print(d, os.path.isdir(d or '') " \
                 "and not os.listdir(d)); sys.exit(0)"


def test_sglang_serving_metrics_gets_a_fresh_multiprocess_directory_before_it_starts_and_it_is_removed_after(capfd):
    """SGLang sets PROMETHEUS_MULTIPROC_DIR only after its plugins loaded, too late once a plugin imported
    prometheus_client: its TTFT and ITL series never reached /metrics. The launcher sets it first."""
    cmd = [sys.executable, "-c", METRICS_SERVER, "--enable-metrics"]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert Supervisor(cmd, env=env).run() == 0
    directory, fresh = capfd.readouterr().out.split()
    assert directory.startswith("/") and fresh == "True"
    assert not os.path.exists(directory)  # nothing left for the next start to count again
    assert Supervisor(cmd[:-1], env=env).run() == 0  # without --enable-metrics: SGLang's own choice
    assert capfd.readouterr().out.split()[0] == "None"
