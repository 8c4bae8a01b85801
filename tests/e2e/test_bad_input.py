"""Bad input gets a 4xx JSON error naming the problem, decided by the router; the cluster serves normally after."""

from __future__ import annotations

import pytest

CASES = [
    pytest.param(b'{"text": "unterminated', 400, "not valid JSON", id="malformed-json"),
    pytest.param(b'{"sampling_params": {"max_new_tokens": 4}}', 400, "one of text or input_ids", id="no-input"),
    pytest.param(b'{"text": 42}', 400, "text", id="text-not-a-string"),
    pytest.param(b'{"input_ids": "1 2 3"}', 400, "input_ids", id="input-ids-not-a-list"),
    pytest.param(b'{"text": "a", "sampling_params": {"max_new_tokens": -3}}', 400, "max_new_tokens",
                 id="negative-max-new-tokens"),
    pytest.param(b'{"text": "a", "sampling_params": {"temperature": -1}}', 400, "temperature",
                 id="negative-temperature"),
    pytest.param(b'{"text": "a", "sampling_params": {"top_p": 0}}', 400, "top_p", id="top-p-zero"),
    pytest.param(b'{"text": "a", "sampling_params": {"top_p": 1.01}}', 400, "top_p", id="top-p-above-one"),
    pytest.param(b'{"text": "a", "stream": "please"}', 400, "stream", id="stream-not-bool"),
]


@pytest.mark.parametrize(("body", "status", "names"), CASES)
def test_bad_input_gets_a_named_4xx(router, body, status, names):
    response = router.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert names in error["message"] and error["type"] == "invalid_request_error" and error["code"] == status


def test_body_over_the_limit_is_413(router):
    limit = 16 * 1024 * 1024  # RouterConfig's default max_body_bytes (tests/e2e/router.yaml keeps it)
    response = router.post("/generate", content=b'{"text": "' + b"a" * limit + b'"}',
                           headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]


def test_cluster_still_answers_normally_after_bad_input(router):
    for case in CASES:
        router.post("/generate", content=case.values[0], headers={"content-type": "application/json"})
    response = router.post("/generate", json={"text": "Still fine?", "sampling_params": {"max_new_tokens": 4,
                                                                                          "temperature": 0}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4
