"""docs/lifecycle.md names each step of a request as `file:function`: every one must exist, so that the page is
renamed with the code, and every router file a streamed request runs code in must be on it (a profiled request).
And the router's code and that page speak of the code, not of the tracker: no issue numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "lifecycle.md"
STEP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def defined_names(path: Path) -> set[str]:
    """Qualified names of the functions and classes of a module: `f`, `C`, `C.method`."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return names


def test_every_step_of_the_lifecycle_page_names_a_function_that_exists():
    steps = STEP.findall(PAGE.read_text())
    assert len(steps) >= 20, "the page names each step as `file:function`"
    missing = [f"{file}:{name}" for file, name in steps
               if not (ROOT / file).is_file() or name not in defined_names(ROOT / file)]
    assert not missing, f"docs/lifecycle.md names what does not exist: {missing}"


def test_the_lifecycle_page_is_the_first_link_of_the_readme_documentation():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Documentation"):]
    first = re.search(r"\[([^\]]+)\]\(([^)]+)\)", table)
    assert first is not None and first.group(2) == "docs/lifecycle.md"


# This project's tracker: the word issue and a number, or a bare "#" and a number. Another project's issue, named
# with it ("sglang #26747", "owner/repo#1"), is a citation of a fact, and stays.
ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w/&])(?<!\w )#\d+\b", re.IGNORECASE)


def test_no_issue_numbers_in_the_router_or_its_lifecycle_page():
    files = [*sorted((ROOT / "router").rglob("*.py")), PAGE]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not found, found


def test_the_page_names_every_router_file_a_streamed_request_runs_code_in():
    """One streamed POST /generate through the router's ASGI app, every Python call profiled: each file of router/
    it ran code in is one a newcomer reads, so the page must name it."""
    ran = _files_a_streamed_request_runs()
    assert "router/pd/attempt.py" in ran and "router/transport/edge.py" in ran
    page = PAGE.read_text()
    missing = sorted(file for file in ran if file not in page)
    assert not missing, f"run but not on the page: {missing}"
    assert len(ran) <= 11, sorted(ran)  # 19 before the spine, 14 before the merges that made it 10; Checked apart: 11


def _files_a_streamed_request_runs() -> set[str]:
    import asyncio
    import json
    import sys
    from contextlib import ExitStack

    from router.app import create_app
    from router.config import RouterConfig
    from tests.fakes import FakeWorker, ServerThread

    ran: set[str] = set()
    router = str(ROOT / "router")

    def profile(frame, event, _arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(router):
            ran.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))

    async def one_request(edge) -> list[dict]:
        body = json.dumps({"text": "hi", "stream": True}).encode()
        inbox, sent, over = [{"type": "http.request", "body": body, "more_body": False}], [], asyncio.Event()

        async def receive() -> dict:
            if inbox:
                return inbox.pop()
            await over.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [(b"content-type", b"x")]}
        async with edge.app.router.lifespan_context(edge.app):
            await asyncio.sleep(0.5)  # the first probes done: from here on, the router runs only this request
            sys.setprofile(profile)
            try:
                await edge(scope, receive, send)
                await asyncio.sleep(0.2)  # what the attempt left in the background
            finally:
                sys.setprofile(None)
                over.set()
        return sent

    with ExitStack() as stack:
        prefill, decode = (stack.enter_context(ServerThread(FakeWorker().app())) for _ in range(2))
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": prefill.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": decode.url}], health_interval=60, liveness_interval=60,
                              admission_check=False)
        sent = asyncio.run(one_request(create_app(config)))
    assert sent[0]["status"] == 200 and b"[DONE]" in b"".join(m.get("body", b"") for m in sent[1:])
    return ran
