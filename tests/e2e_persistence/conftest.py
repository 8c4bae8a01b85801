"""One cluster with its KV cache on disk (`cluster.kv_store`) for the tests of this directory.

Started through pdcluster.local, like tests/e2e, on ports of its own (20xxx): bootstrap service, a prefill (a
second one, sharing its KV namespace, when a test asks), a decode that also writes the KV of what it generates
(decode_offload), and a router that names the pair of every answer (X-Pdcluster-Prefill). The worker configs are
configs/prefill-persistent.yaml and configs/decode-persistent.yaml with a temporary KV directory and the model loaded
through a symlink in a temporary folder: a test can put other weights behind the very same model path, the case a
namespace per model exists for.

Tests change the cluster with `PersistentCluster.ensure` (which restarts only the workers whose options or weights
differ), so each test states the shape it needs and the file order (tests/conftest.py) only decides how many
restarts happen. If the cluster cannot start, every test errors: none is skipped.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from pdcluster.local.cluster import LocalCluster
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.e2e.conftest import demo_model, kill_tree, reference  # noqa: F401 - fixtures shared by import
from tests.e2e.prompts import SENTENCES
from tests.e2e.reference import Reference, ReferenceModel
from tests.helpers import CLUSTER_POLL, give_up, until

# The cluster's relative paths are relative to the working directory: the tests run from the checkout's root.
REPO = Path(__file__).resolve().parents[2]

BOOTSTRAP_PORT, ROUTER_PORT, PREFILL_PORT, KV_BOOTSTRAP_PORT, DECODE_PORT = 20998, 20000, 20100, 20300, 20200
PAGE = 64  # kv_store's page size: only whole pages are stored
DEMO = REPO / "models" / "tiny-llama"
# name -> extra command-line arguments; a worker not listed is stopped. Every HiCache worker needs ~2.7 GiB of RAM,
# and SGLang refuses to start one unless 10 GiB more are available (its host-pool reserve): one prefill by default.
DEFAULT_SHAPE: dict[str, tuple[str, ...]] = {"prefill-0": (), "decode-0": ()}
TWO_PREFILLS: dict[str, tuple[str, ...]] = {"prefill-0": (), "prefill-1": (), "decode-0": ()}
# SGLang checks, when a HiCache worker's scheduler starts, that 10 GiB (HICACHE_HOST_MEMORY_RESERVE_BYTES) plus its
# host pool are still available, after what the starting workers themselves took by then (~2.5 GiB each).
SGLANG_RESERVE_GIB, WORKER_GIB = 10.5, 2.5
MEMORY_REFUSED = ("Not enough host memory available", "No host memory is left for HiCache")


def prompt_ids(tokenizer, tag: str, n_tokens: int) -> list[int]:
    """n_tokens ids (the first is <s>) of words drawn with `tag` as the seed: another tag, another first page, so
    nothing of it is cached by another test."""
    rng = random.Random(tag)
    words = SENTENCES.split()
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids = tokenizer(" ".join(rng.choice(words) for _ in range(2 * n_tokens)))["input_ids"]
    return ids[:n_tokens]


def greedy_ids(model: ReferenceModel, prompt: list[int], max_new_tokens: int) -> Reference:
    """ReferenceModel.greedy for a prompt given as token ids (a next turn's ids do not round-trip through text)."""
    return model.greedy_ids(prompt, max_new_tokens)


@dataclass
class Answer:
    output_ids: list[int]
    cached: int
    tiers: dict  # {"device", "host", "storage"} when SGLang reported any
    prefill: str  # the process name of the prefill that served it, e.g. "prefill-1"
    completion_tokens: int

    @property
    def storage(self) -> int:
        return int(self.tiers.get("storage") or 0)


@dataclass
class PersistentCluster:
    local: LocalCluster
    root: Path
    kv_dir: Path
    model_link: Path
    client: httpx.Client
    base: dict[str, list[str]] = field(default_factory=dict)  # each worker's command as pdcluster.local builds it
    running: dict[str, tuple] = field(default_factory=dict)  # name -> (extra args, model) it was started with

    # -- names and places
    def port(self, name: str) -> int:
        role, index = name.split("-")
        return (PREFILL_PORT if role == "prefill" else DECODE_PORT) + int(index)

    def worker_id(self, name: str) -> str:
        return f"{name.split('-')[0]}-127.0.0.1-{self.port(name)}"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name)}"

    def log(self, name: str) -> Path:
        return self.local.processes[name].log_path

    def namespaces(self, base: Path | None = None) -> list[Path]:
        base = base or self.kv_dir
        return sorted(p for p in base.iterdir() if (p / "namespace.json").is_file()) if base.is_dir() else []

    def pages(self, base: Path | None = None) -> int:
        return sum(1 for ns in self.namespaces(base) for f in ns.iterdir() if f.name.endswith(".bin"))

    def wait_pages(self, at_least: int, base: Path | None = None, timeout: float = 30) -> int:
        """Pages are written by a background thread (and a decode's last page just after its answer): wait for them."""
        until(lambda: self.pages(base) >= at_least, timeout, interval=CLUSTER_POLL)
        return self.pages(base)

    def settle(self, base: Path | None = None, quiet: float = 1.0, timeout: float = 30) -> None:
        """Wait until no page is being written or evicted under `base` for `quiet` seconds (where an evictor keeps
        the count level, counting pages cannot tell)."""
        base = base or self.kv_dir
        last, since = None, time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            now = sorted(str(f) for f in base.rglob("*") if f.name.endswith((".bin", ".tmp")))
            if now != last or any(f.endswith(".tmp") for f in now):
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
            time.sleep(0.1)

    # -- requests
    def generate(self, ids: list[int], max_new_tokens: int, **sampling) -> Answer:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}
        response = self.client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        meta = answer["meta_info"]
        prefill = response.headers["x-pdcluster-prefill"]
        name = f"prefill-{int(prefill.rsplit('-', 1)[1]) - PREFILL_PORT}"
        return Answer(answer["output_ids"], meta.get("cached_tokens", 0), meta.get("cached_tokens_details") or {},
                      name, meta["completion_tokens"])

    # -- shape
    def ensure(self, shape: dict[str, tuple[str, ...]] | None = None, model: Path = DEMO) -> None:
        """Run exactly the workers of `shape`, each with its extra arguments, on the weights in `model`; restart only
        what differs from what runs."""
        shape = DEFAULT_SHAPE if shape is None else shape
        changed = [n for n in self.base if n in shape and self.running.get(n) != (tuple(shape[n]), model)]
        gone = [n for n in self.running if n not in shape]
        if not changed and not gone:
            return
        if model != self.model_target():
            # Every worker that stays up would keep the old weights: restart them all on the new ones.
            changed = [n for n in self.base if n in shape]
        for name in gone + changed:
            self.stop(name)
        self.set_model(model)
        self.wait_for_memory(len(changed))
        for name in changed:
            self.start(name, shape[name], model)
        self.wait_healthy()

    def model_target(self) -> Path:
        return Path(os.readlink(self.model_link))

    def set_model(self, model: Path) -> None:
        tmp = self.model_link.with_name(self.model_link.name + ".new")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(model)
        os.replace(tmp, self.model_link)

    def wait_for_memory(self, workers: int, timeout: float = 300) -> None:
        """Start HiCache workers only when SGLang will let them: with less RAM available it refuses ("Not enough host
        memory available"), e.g. while other clusters run on the machine. Waits for it, then fails saying so."""
        need = (SGLANG_RESERVE_GIB + WORKER_GIB * workers) * 2**30
        if not until(lambda: psutil.virtual_memory().available >= need, timeout, interval=1.0):
            raise RuntimeError(f"{workers} HiCache worker(s) need {need / 2**30:.1f} GiB of available RAM to start "
                               f"(SGLang keeps a 10 GiB reserve); only {psutil.virtual_memory().available / 2**30:.1f}"
                               f" GiB were available for {timeout:.0f}s (other clusters running?)")

    def start(self, name: str, extra: tuple[str, ...] = (), model: Path | None = None) -> None:
        process = self.local.processes[name]
        process.command = [*self.base[name], *extra]
        process.start()
        self.running[name] = (tuple(extra), model or self.model_target())

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.local.processes[name]
        if process.running:
            if sig == signal.SIGKILL:
                kill_tree(process.popen.pid)
            else:
                process.signal(sig)
            try:
                process.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(process.popen.pid)
                process.popen.wait(timeout=30)
        self.running.pop(name, None)
        # The router must have seen it go (SIGTERM deregisters at once; SIGKILL: failed probes, registry TTL).
        assert until(lambda: not self.healthy().get(self.worker_id(name)), 60, interval=CLUSTER_POLL), self.healthy()

    def restart(self, names: list[str], sig: int = signal.SIGTERM) -> None:
        """Stop (SIGTERM, or SIGKILL of the whole process tree) and start again with the same options."""
        before = {n: self.running[n] for n in names}
        for name in names:
            self.stop(name, sig)
        self.wait_for_memory(len(names))
        for name in names:
            self.start(name, *before[name])
        self.wait_healthy()

    def restart_all(self) -> None:
        """The whole cluster, gracefully: router, workers and bootstrap service SIGTERMed, then started again."""
        running = dict(self.running)
        self.local.stop(timeout=60)
        self.running.clear()
        for name in ("bootstrap", "router"):
            self.local.processes[name].start()
        self.wait_for_memory(len(running))
        for name, (extra, model) in running.items():
            self.start(name, extra, model)
        self.wait_healthy()

    def healthy(self) -> dict[str, bool]:
        try:
            workers = self.client.get("/ready", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return {w["worker_id"]: not w["unusable"] for w in workers}  # serving: healthy, in, admitted

    def wait_healthy(self, timeout: float = 600, memory_retries: int = 2) -> None:
        want = {self.worker_id(n) for n in self.running}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in [*self.running, "router", "bootstrap"]:
                process = self.local.processes[name]
                if process.running:
                    continue
                if memory_retries and any(text in process.tail(40) for text in MEMORY_REFUSED):
                    # Another process took the RAM between our check and SGLang's (a shared machine): once more.
                    memory_retries -= 1
                    print(f"{name}: SGLang refused to start for lack of RAM; retrying", file=sys.stderr)
                    self.wait_for_memory(1)
                    process.start()
                    continue
                raise RuntimeError(f"{name} exited ({process.popen.returncode}); its log ends with:\n"
                                   f"{process.tail(40)}")
            healthy = self.healthy()
            if all(healthy.get(w) for w in want) and not any(v for w, v in healthy.items() if w not in want):
                return
            time.sleep(0.5)
        raise TimeoutError(f"workers {sorted(want)} not all healthy after {timeout:.0f}s: {self.healthy()}; "
                           f"logs in {self.local.log_dir}")


def write_worker_config(role: str, model_link: Path, kv_dir: Path, path: Path) -> None:
    raw = yaml.safe_load((REPO / "configs" / f"{role}-persistent.yaml").read_text())
    raw["model-path"] = str(model_link)
    # The demo model under its own name, and its KV pool as ever (the configs' are sized for SmolLM2)
    raw.update({"served-model-name": "tiny-llama", "max-total-tokens": 65536})
    raw["cluster"]["bootstrap_url"] = f"http://127.0.0.1:{BOOTSTRAP_PORT}"
    raw["cluster"]["kv_store"]["dir"] = str(kv_dir)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture(scope="package")
def pc(demo_model, tmp_path_factory) -> PersistentCluster:  # noqa: F811 - the imported fixture
    root = tmp_path_factory.mktemp("persistence")
    kv_dir, model_link = root / "kv", root / "model"
    model_link.symlink_to(DEMO)
    for role in ("prefill", "decode"):
        write_worker_config(role, model_link, kv_dir, root / f"{role}.yaml")
    spec = LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=BOOTSTRAP_PORT),
        router=ComponentSpec(config="tests/e2e_persistence/router.yaml", port=ROUTER_PORT),
        prefill=WorkerGroupSpec(config=str(root / "prefill.yaml"), count=2, first_port=PREFILL_PORT,
                                first_kv_bootstrap_port=KV_BOOTSTRAP_PORT),
        decode=WorkerGroupSpec(config=str(root / "decode.yaml"), count=1, first_port=DECODE_PORT),
        ready_timeout=600,
    )
    local = LocalCluster(spec, root / "logs")
    with httpx.Client(base_url=local.router_url, timeout=180) as client:
        cluster = PersistentCluster(local, root, kv_dir, model_link, client,
                                    base={n: list(p.command) for n, p in local.processes.items()
                                          if n.startswith(("prefill", "decode"))})
        try:
            for name in ("bootstrap", "router"):
                local.processes[name].start()
            cluster.ensure()
        except BaseException:  # an interrupt too
            give_up(local)
            raise
        try:
            yield cluster
        finally:
            local.stop(timeout=60)


@pytest.fixture(scope="package")
def other_model(tmp_path_factory) -> Path:
    """The demo model's shape and tokenizer with other weights (another seed)."""
    out = tmp_path_factory.mktemp("other-model") / "tiny-llama-seed7"
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(out), "--seed", "7"], cwd=REPO,
                   check=True)
    return out


@pytest.fixture(scope="package")
def other_reference(other_model) -> ReferenceModel:
    return ReferenceModel(str(other_model))
