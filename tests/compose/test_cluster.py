"""`docker compose --profile cpu up` for real, and only what Docker adds to what the end-to-end suites check on local
processes: the image's contents, the published port, the compose network (registration by container address,
`--scale`), the kv-cache volume, stop_grace_period and the restart policy, and `down`. One project for the whole
module, in this order (conftest.py brings it up). Where each behaviour the local suites already cover is checked:
docs/testing.md, "What each compose test keeps".

The tests reach the cluster only through the router's published port; the docker CLI is used to act on containers
(stop, kill, scale) and to read their state, never to talk to a service.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter

import httpx

from tests.compose.conftest import PROFILE, REPO, copy_out, serving
from tests.e2e.load import Load
from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import assert_matches
from tests.helpers import until

MODEL = "smollm2-135m-instruct"  # configs/compose/*-cpu.yaml: SmolLM2-135M-Instruct, built into the image
MAX_NEW = 16
# A few hundred tokens at most: one SmolLM2 prefill forward stays well under a second or two on 2 busy cores.
LONG = 300
PAGE = 64  # kv_store's page size (SGLang's on the CPU profile): only whole pages are written to the volume
# The stream a stopped decode must finish: mid-way when `docker stop` comes (it comes after the first token), and short
# enough to end within the launcher's drain (the grace period less 10 s: 50 s) on a loaded 2-core machine. 96 tokens
# did not: with other clusters on the cores a decode made ~1.2 tokens/s, and was killed at 62.
STREAM_TOKENS = 24
LONG_STREAM = {"text": "Count slowly", "stream": True,
               "sampling_params": {"max_new_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}}
PREFILL, DECODE = f"prefill-{PROFILE}", f"decode-{PROFILE}"


def greedy(text: str, max_new: int = MAX_NEW, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def workers(project) -> list[dict]:
    return project.ready_listing()[1]


def serving_ids(project, role: str) -> set[str]:
    return {w["worker_id"] for w in serving(workers(project), role)}


def wait_until_out_of_rotation(project, role: str, worker_id: str, timeout: float = 60) -> None:
    """Until the router no longer sends requests to worker_id (it noticed the worker went away)."""
    deadline = time.monotonic() + timeout
    while worker_id in serving_ids(project, role):
        assert time.monotonic() < deadline, f"the router still sends requests to {worker_id} after {timeout:.0f} s"
        time.sleep(0.5)


def container_ip(project, container: str) -> str:
    networks = project.inspect(container)["NetworkSettings"]["Networks"]
    return next(iter(networks.values()))["IPAddress"]


# ------------------------------------------------------------------------------------------------------ the image

def test_image_models_are_built_as_on_the_host(engine, image, image_model):
    """The image builds SmolLM2 with scripts/fetch_smollm2.py and the demo model with scripts/build_demo_model.py, as
    `make setup` does on the host: the same float32 weights, bit for bit (the same pinned GGUF unpacked by the same
    transformers; the demo model is seeded), and the same config. The demo model's tokenizer is trained on the
    docstrings of the Python that builds it, so it may differ between Python patch releases."""
    tag = next(iter(image))
    models = {"smollm2-135m-instruct": image_model, "tiny-llama": copy_out(engine, tag, "tiny-llama")}
    for name, built in models.items():
        host_dir = REPO / "models" / name
        assert (host_dir / "build-info.json").is_file(), f"{host_dir} is missing: `make setup` builds it"
        for file in ("config.json", "model.safetensors"):
            digest = [hashlib.sha256((d / file).read_bytes()).hexdigest() for d in (host_dir, built)]
            assert digest[0] == digest[1], f"{file} differs between the host's {name} and the image's"
        config = json.loads((built / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == "float32"


# ------------------------------------------------------------------------------------------- one prefill, one decode

def test_only_the_router_is_published_and_on_loopback(project):
    published = {}
    for container in project.containers():
        info = project.inspect(container)
        service = info["Config"]["Labels"]["com.docker.compose.service"]
        bindings = {port: b for port, b in (info["HostConfig"]["PortBindings"] or {}).items() if b}
        if bindings:
            published[service] = bindings
    assert published == {"router": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(project.port)}]}}


def test_the_image_serves_through_the_published_port_what_transformers_computes(router, reference):
    """The cluster's wiring is tests/e2e_smollm2's; what only this checks is the image: its SGLang, torch and
    Mooncake, the tokenizer and chat template it holds, configs/compose's served model name, over the compose
    network."""
    response = router.get("/ready")
    assert response.status_code == 200, response.text
    listing = response.json()["workers"]
    assert Counter(w["role"] for w in serving(listing, "prefill") + serving(listing, "decode")) == \
        {"prefill": 1, "decode": 1}, listing
    assert router.get("/health").json() == {"status": "ok"}
    assert MODEL in [m["id"] for m in router.get("/v1/models").json()["data"]]

    text = "The capital of France is"
    ref = reference.greedy(text, MAX_NEW)
    answer = router.post("/generate", json=greedy(text))
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    assert_matches(answer.json()["output_ids"], ref, reference.eos)
    assert answer.json()["text"].startswith(" Paris."), answer.text  # what the README's quickstart shows

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = router.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 16,
                                                     "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


# ------------------------------------------------------------------------------------- scaling and the kv-cache volume

def served_by(router: httpx.Client, reference, n: int) -> Counter:
    """n requests, each checked against transformers; which prefill/decode pair served each."""
    pairs = Counter()
    for i in range(n):
        text = f"Request number {i} asks the cluster for a few words."
        response = router.post("/generate", json=greedy(text, 8))
        assert response.status_code == 200, response.text
        assert_matches(response.json()["output_ids"], reference.greedy(text, 8), reference.eos)
        pairs[(response.headers["x-pdcluster-prefill"], response.headers["x-pdcluster-decode"])] += 1
    return pairs


def kv_pages(project, container: str) -> int:
    """KV page files in the kv-cache volume, counted inside a container that mounts it."""
    count = "import pathlib; print(sum(1 for _ in pathlib.Path('/app/kv-cache').rglob('*.bin')))"
    return int(project.docker("exec", container, "python", "-c", count).stdout)


def test_scaled_replicas_register_their_own_addresses_and_a_new_prefill_reads_the_shared_volume(
        project, router, reference):
    """`--scale` to two prefills and two decodes: each replica registers its container's address and serves. The
    kv-cache volume is what the replicas share (docker-compose.yml): a ~300-token prompt whose KV pages the first
    prefill wrote is a storage hit on the second, a container that never computed it. (That one worker's pages
    survive its restart, and that replicas of local processes share them, tests/e2e_smollm2 and
    tests/e2e_persistence check.)"""
    (first_prefill,) = project.containers(PREFILL)
    text = "Notes for the next meeting. " + prompt_of_about(reference.tokenizer, LONG)  # not cached by another test
    ref = reference.greedy(text, 8)
    whole_pages = (len(ref.prompt_ids) - 1) // PAGE  # the prompt's last token is always computed, never stored
    pages = kv_pages(project, first_prefill)
    first = router.post("/generate", json=greedy(text, 8))
    assert first.status_code == 200, first.text
    assert_matches(first.json()["output_ids"], ref, reference.eos)
    assert until(lambda: kv_pages(project, first_prefill) >= pages + whole_pages, 60, 1.0), \
        f"{kv_pages(project, first_prefill) - pages} of the prompt's {whole_pages} pages written"

    project.up("--scale", f"{PREFILL}=2", "--scale", f"{DECODE}=2")
    assert len(project.containers(PREFILL)) == 2 and len(project.containers(DECODE)) == 2
    listing = project.wait_for_workers(2, 2)
    for service, role in ((PREFILL, "prefill"), (DECODE, "decode")):
        ips = {container_ip(project, c) for c in project.containers(service)}
        assert {httpx.URL(w["url"]).host for w in serving(listing, role)} == ips
    pairs = served_by(router, reference, 8)
    ids = {role: {w["worker_id"] for w in serving(listing, role)} for role in ("prefill", "decode")}
    assert {p for p, _ in pairs} == ids["prefill"], pairs
    assert {d for _, d in pairs} == ids["decode"], pairs

    new_prefill = next(w["worker_id"] for w in serving(listing, "prefill")
                       if httpx.URL(w["url"]).host != container_ip(project, first_prefill))
    for _ in range(4):  # round robin over two prefills
        again = router.post("/generate", json=greedy(text, 8))
        assert again.status_code == 200, again.text
        if again.headers["x-pdcluster-prefill"] == new_prefill:
            break
    assert again.headers["x-pdcluster-prefill"] == new_prefill, "no request reached the new prefill"
    meta = again.json()["meta_info"]
    storage = int((meta.get("cached_tokens_details") or {}).get("storage") or 0)
    assert meta["cached_tokens"] >= whole_pages * PAGE and storage >= whole_pages * PAGE, meta
    assert again.json()["output_ids"] == first.json()["output_ids"]


# ---------------------------------------------------------------------------------------------- workers that stop

def decode_worker_id(project, container: str) -> str:
    ip = container_ip(project, container)
    listing = workers(project)
    matches = [w["worker_id"] for w in listing if w["role"] == "decode" and httpx.URL(w["url"]).host == ip]
    assert len(matches) == 1, (ip, listing)
    return matches[0]


class StreamOn:
    """A long greedy stream through the router, on one given decode, read to its end in a thread of its own while the
    test stops that decode's container."""

    def __init__(self, url: str, decode_id: str):
        self.url, self.decode_id, self.events, self.landed_on = url, decode_id, [], []
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            # Round robin, with the load's requests in between: each try lands on the wanted decode about one time in
            # two, so 30 tries all miss it about once in a billion runs.
            for _ in range(30):
                with client.stream("POST", "/generate", json=LONG_STREAM) as response:
                    self.landed_on.append(response.headers.get("x-pdcluster-decode"))
                    if self.landed_on[-1] != self.decode_id:
                        continue  # closing it aborts that request; the next one goes to the other decode
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line.removeprefix("data: "))
                    return

    def whole(self) -> bool:
        self.thread.join(timeout=180)
        return (not self.thread.is_alive() and len(self.events) > 2 and self.events[-1] == "[DONE]"
                and json.loads(self.events[-2])["meta_info"]["completion_tokens"] == STREAM_TOKENS)


def test_a_worker_stopped_by_hand_drains_and_stays_down_and_a_crashed_one_is_restarted(project, router, reference):
    """`docker stop` of a decode while it streams, under a steady load: Docker's SIGTERM reaches the launcher through
    the container's init, the worker leaves the pools, SGLang finishes the stream within stop_grace_period (Docker
    kills only after it), no request of the load fails, and no restart policy starts a container stopped by hand.
    Then a crash of the other decode (SIGKILL of its processes, as an OOM kill would): `restart: unless-stopped`
    starts it again, and `docker compose up` the stopped one; both register again and serve. (The drain itself, a
    restart under load of each role on local processes: tests/e2e/test_planned_events.py.)"""
    stopped, crashed = project.containers(DECODE)
    stopped_id, crashed_id = decode_worker_id(project, stopped), decode_worker_id(project, crashed)
    grace = project.inspect(stopped)["Config"]["StopTimeout"]
    want = int(project.env.get("PDCLUSTER_GRACE_SECONDS") or 60)  # docker-compose.yml's stop_grace_period
    assert grace == want, f"stop_grace_period did not reach the container: StopTimeout {grace}, not {want}"
    stopped_restarts = project.inspect(stopped)["RestartCount"]

    with Load(project.url, model=MODEL) as load:
        stream = StreamOn(project.url, stopped_id)
        assert until(lambda: stream.events, 120, 0.2), f"no stream started on {stopped_id}: {stream.landed_on}"
        began = time.monotonic()
        project.docker("stop", stopped, timeout=grace + 60)  # waits for the container's StopTimeout at most
        took = time.monotonic() - began
        answered = load.answers
        assert until(lambda: load.answers >= answered + 4, 120, 0.2), "the load got no answers after the stop"
    assert stream.whole(), f"the stream on the stopped decode: {stream.events[-2:]}"
    assert took < grace, f"docker stop took {took:.0f} s: Docker killed the worker at its grace period"
    assert load.problems == [], load.problems[:5]
    assert stopped_id not in {d for _, d in served_by(router, reference, 2)}

    crashed_restarts = project.inspect(crashed)["RestartCount"]
    project.docker("exec", crashed, "sh", "-c", "kill -KILL -1", check=False)  # all but the container's init
    assert until(lambda: project.inspect(crashed)["RestartCount"] > crashed_restarts, 60, 0.5), \
        "the crashed decode's container was not restarted"
    wait_until_out_of_rotation(project, "decode", crashed_id)
    # Seconds since the stop by hand, and a crash restarted meanwhile: a policy that restarts it would have by now.
    info = project.inspect(stopped)
    assert info["State"]["Status"] == "exited" and info["RestartCount"] == stopped_restarts, info["State"]

    project.up("--scale", f"{PREFILL}=2", "--scale", f"{DECODE}=2")
    assert project.inspect(stopped)["State"]["Status"] == "running"
    # Each registers its container's address anew (the address may change with a restart).
    back = {decode_worker_id(project, stopped), decode_worker_id(project, crashed)}
    assert {d for _, d in served_by(router, reference, 4)} == back


# ------------------------------------------------------------------------------------------------------------ down

def test_down_removes_containers_and_network_and_keeps_volumes_unless_asked(project):
    project.save_logs()  # every container's log, for the record, before they go
    project.compose("down", "--timeout", "20", timeout=300)
    label = f"label=com.docker.compose.project={project.name}"
    assert project.containers(all=True) == []
    assert project.docker("network", "ls", "-q", "--filter", label).stdout.decode().split() == []
    volumes = project.docker("volume", "ls", "--format", "{{.Name}}", "--filter", label).stdout.decode().split()
    assert f"{project.name}_kv-cache" in volumes, volumes
    project.compose("down", "--volumes", timeout=300)
    assert project.docker("volume", "ls", "-q", "--filter", label).stdout.decode().split() == []
