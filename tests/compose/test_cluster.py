"""`docker compose --profile cpu up` for real: the image, the published port, exact tokens, scaling, a worker that dies,
the KV cache volume, and `down`. One project for the whole module, in this order (conftest.py brings it up).

The tests reach the cluster only through the router's published port; the docker CLI is used to act on containers
(restart, kill, scale) and to read their state, never to talk to a service.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.compose.conftest import PROFILE, REPO, copy_out, serving
from tests.e2e.load import Load
from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import assert_matches

MODEL = "smollm2-135m-instruct"  # configs/compose/*-cpu.yaml: SmolLM2-135M-Instruct, built into the image
MAX_NEW = 16
# A few hundred tokens at most: one SmolLM2 prefill forward stays well under a second or two on 2 busy cores.
LONG = 300
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


def generate(router: httpx.Client, body: dict, attempts_for: float = 0) -> httpx.Response:
    """POST /generate; with attempts_for, 5xx answers are retried for that long (a worker just came back)."""
    deadline = time.monotonic() + attempts_for
    while True:
        response = router.post("/generate", json=body)
        if response.status_code < 500 or time.monotonic() >= deadline:
            return response
        time.sleep(1)


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


def test_router_is_ready_with_one_prefill_and_one_decode(router):
    response = router.get("/ready")
    assert response.status_code == 200, response.text
    listing = response.json()["workers"]
    assert Counter(w["role"] for w in serving(listing, "prefill") + serving(listing, "decode")) == \
        {"prefill": 1, "decode": 1}, listing
    assert router.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("size", [5, 100, LONG])
def test_generate_equals_transformers(router, reference, size):
    text = "The capital of France is" if size == 5 else prompt_of_about(reference.tokenizer, size)
    ref = reference.greedy(text, MAX_NEW)
    response = router.post("/generate", json=greedy(text))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    assert_matches(answer["output_ids"], ref, reference.eos)
    if size == 5:
        assert answer["text"].startswith(" Paris."), answer["text"]  # what the README's quickstart shows


def test_streamed_generate_equals_transformers(router, reference):
    text = prompt_of_about(reference.tokenizer, 100)
    ref = reference.greedy(text, MAX_NEW)
    with router.stream("POST", "/generate", json=greedy(text, stream=True)) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert_matches(json.loads(events[-2])["output_ids"], ref, reference.eos)


def test_openai_client(project, router, reference):
    client = openai.OpenAI(base_url=f"{project.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert MODEL in [m.id for m in client.models.list().data]
    prompt = "Once upon a time"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    ref = reference.greedy(prompt, MAX_NEW)
    want = reference.tokenizer.decode([t for t in ref.ids if t != reference.eos])
    assert completion.choices[0].text == want
    assert completion.usage.prompt_tokens == len(ref.prompt_ids)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == "The capital of France is Paris."
    # The same prompt as token ids through the native API: the OpenAI path adds nothing of its own.
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    native = router.post("/generate", json={"input_ids": list(ids),
                                            "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).json()
    assert chat.choices[0].message.content == native["text"]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == native["text"]


# ------------------------------------------------------------------------------------------------ the kv-cache volume

def test_kv_cache_volume_serves_a_restarted_prefill(project, router, reference):
    """configs/compose/prefill-cpu.yaml's kv_store writes KV pages to the kv-cache volume: after the prefill's
    container restarts (its memory gone), a known ~300-token prompt is a storage hit (its 4 whole pages)."""
    text = "Notes for the next meeting. " + prompt_of_about(reference.tokenizer, LONG)  # not cached by another test
    first = generate(router, greedy(text, 8))
    assert first.status_code == 200, first.text
    time.sleep(3)  # pages are written through as they fill; give the last ones time to land on disk
    prefill = project.containers(PREFILL)
    assert len(prefill) == 1
    (worker_id,) = serving_ids(project, "prefill")
    started_before = project.inspect(prefill[0])["State"]["StartedAt"]
    project.compose("restart", PREFILL, timeout=300)
    assert project.inspect(prefill[0])["State"]["StartedAt"] != started_before
    wait_until_out_of_rotation(project, "prefill", worker_id)
    project.wait_for_workers(1, 1)
    second = generate(router, greedy(text, 8), attempts_for=60)
    assert second.status_code == 200, second.text
    meta = second.json()["meta_info"]
    assert meta["cached_tokens"] >= 256, (f"{meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached "
                                          f"(details: {meta.get('cached_tokens_details')})")
    assert second.json()["output_ids"] == first.json()["output_ids"]


# ------------------------------------------------------------------------------------------------------ scaling

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


def test_scale_to_two_prefills_and_two_decodes(project, router, reference):
    project.up("--scale", f"{PREFILL}=2", "--scale", f"{DECODE}=2")
    assert len(project.containers(PREFILL)) == 2 and len(project.containers(DECODE)) == 2
    listing = project.wait_for_workers(2, 2)
    # Each replica registered its own container address with the bootstrap service.
    for service, role in ((PREFILL, "prefill"), (DECODE, "decode")):
        ips = {container_ip(project, c) for c in project.containers(service)}
        assert {httpx.URL(w["url"]).host for w in serving(listing, role)} == ips
    pairs = served_by(router, reference, 8)
    ids = {role: {w["worker_id"] for w in serving(listing, role)} for role in ("prefill", "decode")}
    assert {p for p, _ in pairs} == ids["prefill"], pairs
    assert {d for _, d in pairs} == ids["decode"], pairs


def test_restarting_one_container_at_a_time_under_load_loses_no_request(project, router):
    """A rolling restart as an operator does it: `docker restart` of one prefill, then one decode, while a steady load
    runs. Each container's launcher leaves the pools at SIGTERM and SGLang finishes its requests within
    stop_grace_period (PDCLUSTER_GRACE_SECONDS); the router sends the rest to the other replica; every answer is
    whole."""
    listing = project.wait_for_workers(2, 2)
    with Load(project.url, model=MODEL) as load:
        for service, role in ((PREFILL, "prefill"), (DECODE, "decode")):
            container = project.containers(service)[0]
            before = {w["worker_id"] for w in serving(listing, role)}
            project.docker("restart", container, timeout=300)
            listing = project.wait_for_workers(2, 2)
            after = {w["worker_id"] for w in serving(listing, role)}
            assert after == before, f"{service} restarted: serving {after}, before {before}"  # admitted anew
    assert load.problems == [], load.problems[:5]
    assert load.answers >= 4


# ---------------------------------------------------------------------------------------------- workers that die

def decode_worker_id(project, container: str) -> str:
    ip = container_ip(project, container)
    listing = workers(project)
    matches = [w["worker_id"] for w in listing if w["role"] == "decode" and httpx.URL(w["url"]).host == ip]
    assert len(matches) == 1, (ip, listing)
    return matches[0]


def test_crashed_worker_is_restarted_by_its_policy_and_registers_again(project, router, reference):
    """A decode's processes die (SIGKILL, as an OOM kill or a crash would): the container exits, `restart:
    unless-stopped` starts it again, the new worker registers, and the cluster serves through it."""
    victim = project.containers(DECODE)[0]
    worker_id = decode_worker_id(project, victim)
    restarts = project.inspect(victim)["RestartCount"]
    project.docker("exec", victim, "sh", "-c", "kill -KILL -1", check=False)  # all but the container's init
    deadline = time.monotonic() + 60
    while project.inspect(victim)["RestartCount"] == restarts:
        assert time.monotonic() < deadline, "the killed decode's container was not restarted"
        time.sleep(0.5)
    # Out of rotation while it starts again (the router notices within a health interval), then back.
    wait_until_out_of_rotation(project, "decode", worker_id)
    project.wait_for_workers(2, 2)
    assert worker_id in serving_ids(project, "decode")
    assert worker_id in {d for _, d in served_by(router, reference, 4)}


def test_compose_kill_stops_a_worker_until_it_is_started_again(project, router, reference):
    """`docker compose kill` is a stop by hand to Docker: no restart policy restarts it (only a crash, above, is
    restarted). The other decode serves meanwhile; `docker compose up` brings the killed one back."""
    victim = project.containers(DECODE)[-1]
    worker_id = decode_worker_id(project, victim)
    restarts = project.inspect(victim)["RestartCount"]
    project.docker("kill", victim)  # `docker compose kill` would kill every replica of the service; this is one
    wait_until_out_of_rotation(project, "decode", worker_id)
    project.wait_for_workers(2, 1, timeout=60)
    time.sleep(5)
    info = project.inspect(victim)
    assert info["State"]["Status"] == "exited" and info["RestartCount"] == restarts, info["State"]
    assert worker_id not in {d for _, d in served_by(router, reference, 2)}
    project.up("--scale", f"{PREFILL}=2", "--scale", f"{DECODE}=2")
    assert project.inspect(victim)["State"]["Status"] == "running"
    assert worker_id in {d for _, d in served_by(router, reference, 4)}


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
