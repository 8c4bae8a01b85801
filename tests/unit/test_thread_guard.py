"""pdcluster/plugins/thread_guard.py: an SGLang KV-transfer thread that dies ends the worker (no zombie that the router
keeps pairing); any other thread's death, and a process without the variable, are left as SGLang has them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from pdcluster.plugins import thread_guard
from pdcluster.worker.supervisor import Supervisor

# What SGLang 0.5.23's transfer worker raised in CI: a room cleared by the scheduler thread between two lookups.
DYING_THREAD = "def transfer_worker():\n    raise KeyError(8753473380615765753)\n"


def thread_dying_in(filename: str) -> threading.Thread:
    namespace: dict[str, object] = {}
    exec(compile(DYING_THREAD, filename, "exec"), namespace)
    return threading.Thread(target=namespace["transfer_worker"], name="Thread-6 (transfer_worker)")


def run_guarded(filename: str) -> tuple[list[str], list[type]]:
    ended: list[str] = []
    seen: list[type] = []
    previous = threading.excepthook
    threading.excepthook = thread_guard.guard(lambda args: seen.append(args.exc_type), thread_guard.watched_dir(),
                                              end=lambda: ended.append("ended"))
    try:
        thread = thread_dying_in(filename)
        thread.start()
        thread.join()
    finally:
        threading.excepthook = previous
    return ended, seen


def test_a_transfer_thread_that_dies_ends_the_worker_after_sglangs_own_report():
    ended, seen = run_guarded(os.path.join(thread_guard.watched_dir(), "mooncake", "conn.py"))
    assert ended == ["ended"]
    assert seen == [KeyError]  # the previous hook (SGLang's traceback on stderr) still ran


def test_a_thread_dying_elsewhere_is_left_alone():
    ended, seen = run_guarded(os.path.join(os.path.dirname(thread_guard.watched_dir().rstrip(os.sep)), "managers",
                                           "scheduler.py"))
    assert ended == []
    assert seen == [KeyError]


def test_off_without_the_variable_and_installed_once_with_it(monkeypatch):
    original = threading.excepthook
    monkeypatch.setattr(threading, "excepthook", original)
    monkeypatch.delenv(thread_guard.ENV_VAR, raising=False)
    thread_guard.register()
    assert threading.excepthook is original

    monkeypatch.setenv(thread_guard.ENV_VAR, "1")
    thread_guard.register()
    installed = threading.excepthook
    thread_guard.register()  # SGLang calls register() again in each child it forks
    assert installed is not original and threading.excepthook is installed


def test_the_guard_refuses_to_start_when_sglang_has_no_disaggregation_package(monkeypatch):
    monkeypatch.setattr(thread_guard, "WATCHED_PACKAGE", "sglang.srt.no_such_package")
    with pytest.raises(SystemExit, match=r"no package sglang\.srt\.no_such_package"):
        thread_guard.watched_dir()


# The real chain with real processes: the launcher's Supervisor starts a stand-in for SGLang's main process (its
# SIGQUIT handler ends its tree, as SGLang's does), which starts a "scheduler" whose transfer thread dies.
FAKE_SCHEDULER = textwrap.dedent(f"""
    import os, threading, time
    from pdcluster.plugins import thread_guard
    thread_guard.register()
    namespace = {{}}
    exec(compile({DYING_THREAD!r}, os.path.join(thread_guard.watched_dir(), "mooncake", "conn.py"), "exec"),
         namespace)
    threading.Thread(target=namespace["transfer_worker"]).start()
    time.sleep(600)
""")
FAKE_SGLANG_MAIN = textwrap.dedent(f"""
    # stands in for sglang.launch_server
    import os, signal, subprocess, sys, time
    scheduler = subprocess.Popen([sys.executable, "-c", {FAKE_SCHEDULER!r}])
    def on_sigquit(*_):
        scheduler.kill()
        os._exit(7)
    signal.signal(signal.SIGQUIT, on_sigquit)
    time.sleep(600)
""")


def test_the_launcher_sees_sglang_end_when_a_transfer_thread_dies():
    env = {**os.environ, thread_guard.ENV_VAR: "1", "PYTHONPATH": os.getcwd()}
    # Without the guard the stand-in sleeps its 600 s and ends with status 0 (or the suite's timeout ends it first).
    assert Supervisor([sys.executable, "-c", FAKE_SGLANG_MAIN], env).run() == 7



def test_sglangs_own_plugin_loader_installs_the_guard():
    """What SGLang runs in its main process and each child: the entry point (pyproject.toml) is wired."""
    code = ("import threading; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "print(getattr(threading.excepthook, 'pdcluster_guard', False))")
    env = {**os.environ, thread_guard.ENV_VAR: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


def test_without_the_launchers_session_the_outermost_sglang_process_is_told_never_its_parent():
    """SGLang started by hand with the variable set: the process group is not SGLang's. The stand-in's parent is a
    plain process (no "sglang" in its command line), which must outlive the stand-in's end and report it."""
    wrapper = ("import os, subprocess, sys; "
               "sys.exit(subprocess.call([sys.executable, '-c', os.environ['STAND_IN']]))")
    env = {**os.environ, thread_guard.ENV_VAR: "1", "PYTHONPATH": os.getcwd(), "STAND_IN": FAKE_SGLANG_MAIN}
    done = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 7, done.stderr[-2000:]  # the stand-in's SIGQUIT handler ran; the wrapper was spared


def test_a_process_group_whose_leader_is_gone_does_not_stop_the_guard():
    """SGLang started in the background by a shell that then ended (as CI's runner did): the group's leader no longer
    exists. The outermost SGLang process is still told (here the stand-in, whose handler exits 7)."""
    wrapper = ("import os, subprocess, sys, time\n"
               "while os.path.exists(f'/proc/{os.getpgrp()}'): time.sleep(0.05)  # until the leader is reaped\n"
               "print(subprocess.call([sys.executable, '-c', os.environ['STAND_IN']]), flush=True)")
    leader = f"import os, subprocess, sys; os.setpgid(0, 0); subprocess.Popen([sys.executable, '-c', {wrapper!r}])"
    env = {**os.environ, thread_guard.ENV_VAR: "1", "PYTHONPATH": os.getcwd(), "STAND_IN": FAKE_SGLANG_MAIN}
    with subprocess.Popen([sys.executable, "-c", leader], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        proc.wait(timeout=60)  # the leader ends at once and is reaped here; its group lives on without it
        out, err = proc.communicate(timeout=300)  # the wrapper prints the stand-in's status on the shared pipe
    assert out.strip() == "7", err[-2000:]
