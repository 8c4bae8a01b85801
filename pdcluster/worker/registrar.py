"""Keep a worker's entry in the bootstrap service true: register once SGLang answers, heartbeat, deregister on exit.

Runs in a thread of the worker launcher. The bootstrap service may restart at any time: a heartbeat answered with 404
means it forgot us, and we register again, so a restarted service is whole again within one heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from pdcluster.worker.plan import LaunchPlan

log = logging.getLogger("pdcluster.worker")


class Registrar:
    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.registration = plan.registration
        token = plan.cluster.resolved_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.service = httpx.Client(base_url=plan.cluster.bootstrap_url or "", headers=headers, timeout=3.0)
        self.probe = httpx.Client(timeout=3.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self.registered = False

    def start(self, _proc: object = None) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.registered:
            try:
                self.service.delete(f"/v1/workers/{self.registration.worker_id}")
            except httpx.HTTPError as exc:
                log.warning("could not deregister %s: %s", self.registration.worker_id, exc)

    def _sglang_healthy(self) -> tuple[bool, str]:
        try:
            response = self.probe.get(self.plan.health_url)
        except httpx.HTTPError as exc:
            return False, f"SGLang /health unreachable: {type(exc).__name__}"
        return response.status_code == 200, "" if response.status_code == 200 else f"SGLang /health {response.status_code}"

    def _wait_until_serving(self) -> bool:
        deadline = time.monotonic() + self.plan.cluster.ready_timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self._sglang_healthy()[0]:
                return True
            self._stop.wait(1.0)
        return False

    def _register(self) -> None:
        response = self.service.put(
            f"/v1/workers/{self.registration.worker_id}", content=self.registration.model_dump_json()
        , headers={"content-type": "application/json"})
        if response.status_code >= 400:
            log.error("bootstrap service refused registration (%s): %s", response.status_code, response.text)
            return
        self.registered = True
        incompatible = response.json().get("incompatible")
        if incompatible:
            log.warning("%s cannot be paired: %s", self.registration.worker_id, incompatible)
        log.info("registered %s as %s", self.registration.worker_id, self.registration.url)

    def _run(self) -> None:
        if not self._wait_until_serving():
            return
        interval = self.plan.cluster.heartbeat_interval
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                else:
                    healthy, detail = self._sglang_healthy()
                    response = self.service.post(
                        f"/v1/workers/{self.registration.worker_id}/heartbeat",
                        json={"healthy": healthy, "detail": detail},
                    )
                    if response.status_code == 404:
                        self.registered = False
                        continue
            except httpx.HTTPError as exc:
                log.debug("bootstrap service unreachable: %s", exc)
            self._stop.wait(interval)
