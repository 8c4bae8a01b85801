"""`make bench-clients` (`python -m bench.openai.clients`): guidellm, a load generator people point at OpenAI-compatible
servers, against a running router (`make up`'s by default): a short streamed load on /v1/chat/completions and
/v1/completions, at 1 and 4 concurrent streams. It fails (exit 1) when any request errored, was left incomplete or
came back in a shape guidellm could not parse (bench/openai/clients_report.py); its numbers are a by-product.

guidellm runs from its own venv (.venv-clients, pinned by bench/openai/clients-requirements.txt: it clashes with
SGLang's pins), offline: synthetic prompts sized with the model folder's tokenizer, nothing fetched from a hub. Writes
bench/results/clients.json and .png; guidellm's own reports and logs stay in a temporary folder, printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.harness.machine import machine
from bench.harness.paths import REPO, RESULTS
from bench.openai import clients_report

GUIDELLM = REPO / ".venv-clients" / "bin" / "guidellm"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# No hub, no telemetry: guidellm has none of its own; these keep transformers, datasets and huggingface_hub from
# calling out. Under strace, a run with them connected to 127.0.0.1 only.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def command(guidellm: Path, url: str, endpoint: str, args: argparse.Namespace, out: Path) -> list[str]:
    """One guidellm run: every concurrency in `args.streams` in turn, `args.requests` requests each. guidellm's
    options are `kind=...,key=value` strings; a list (the streams) goes through --override."""
    backend = (f"kind=openai_http,target={url},model={args.model},request_format={endpoint},stream=true,"
               f"timeout={args.timeout}")
    return [str(guidellm.absolute()), "run", "--backend", backend,
            "--profile", f"kind=concurrent,streams={args.streams[0]}",
            "--override", "profile.streams", ",".join(str(s) for s in args.streams),
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer.resolve()}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def environment() -> dict:
    env = {**os.environ, **OFFLINE}
    # the main venv's packages must not shadow the clients venv's (the clash the separate venv avoids)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def router_up(url: str) -> str | None:
    """None when the router answers /v1/models, else why not: a clearer first failure than guidellm's."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as answer:
            json.load(answer)
        return None
    except (OSError, ValueError) as exc:
        return f"no router answering at {url}/v1/models ({exc}): start one (`make up`) or pass ROUTER_URL="


def run_one(name: str, cmd: list[str], work: Path) -> tuple[dict | None, str | None]:
    """guidellm's report, or why there is none (its exit code and the log's tail)."""
    log = work / f"guidellm-{name}.log"
    with log.open("w") as handle:  # in the temporary folder: guidellm reads a .env and writes defaults there
        code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=environment(), cwd=work).returncode
    out = Path(cmd[cmd.index("--output") + 1].split("path=", 1)[1])
    if code != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        return None, f"guidellm exited {code} ({log}):\n{tail}"
    return json.loads(out.read_text()), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openai.clients", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default: make up's)")
    parser.add_argument("--guidellm", type=Path, default=GUIDELLM, help="default .venv-clients/bin/guidellm")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    parser.add_argument("--tokenizer", type=Path, default=REPO / "models" / "smollm2-135m-instruct",
                        help="a local model folder: sizes the synthetic prompts, offline")
    parser.add_argument("--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=list(ENDPOINTS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="concurrent streams, one cell each")
    parser.add_argument("--requests", type=int, default=16, help="requests per cell")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64, help="sent with ignore_eos: each answer this long")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one request may take")
    parser.add_argument("--out", type=Path, default=RESULTS / "clients",
                        help="summary path without extension")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    for needed, hint in ((args.guidellm, "`make bench-clients` builds .venv-clients"),
                         (args.tokenizer, "`make model` fetches SmolLM2")):
        if not needed.exists():
            print(f"bench-clients: {needed} is missing: {hint}", file=sys.stderr)
            return 2
    if why := router_up(url):
        print(f"bench-clients: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    t0 = time.monotonic()
    reports, failures = {}, []
    for name in args.endpoints:
        cmd = command(args.guidellm, url, ENDPOINTS[name], args, work / f"guidellm-{name}.json")
        print(f"[bench-clients {time.monotonic() - t0:4.0f}s] {name}: {' '.join(cmd)}", flush=True)
        rep, failure = run_one(name, cmd, work)
        if rep is None:
            failures.append(f"{name}: {failure}")
        else:
            reports[f"guidellm-{name}.json"] = rep
    summary = clients_report.result(reports, {
        "url": url, "model": args.model, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "requests_per_cell": args.requests, "streams": args.streams, "machine": machine(),
        "guidellm_reports": str(work), "wall_seconds": round(time.monotonic() - t0)})
    summary["problems"] = failures + summary["problems"]
    summary["passed"] = not summary["problems"]
    clients_report.write(summary, args.out)
    print("\n".join(clients_report.report_lines(summary)))
    print(f"bench-clients: {'passed' if summary['passed'] else 'FAILED'}; wrote {args.out}.json and .png in "
          f"{summary['wall_seconds']} s (guidellm's reports and logs: {work})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
