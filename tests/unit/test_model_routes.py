"""GET /v1/models/{id}: a model's card as SGLang answers it, and an OpenAI-shaped 404 for an id no worker serves."""

import httpx

from tests.fakes import FakeWorker
from tests.unit.test_router_pd import cluster


def test_a_served_model_has_its_card_and_another_id_is_a_404_naming_model():
    with cluster(FakeWorker(), FakeWorker()) as url:
        listed = httpx.get(f"{url}/v1/models").json()
        card = httpx.get(f"{url}/v1/models/fake")
        unknown = httpx.get(f"{url}/v1/models/org/other-model")
        contract = httpx.get(f"{url}/openapi.json").json()
    assert card.status_code == 200 and card.json() == listed["data"][0] == {"id": "fake", "object": "model"}
    assert unknown.status_code == 404
    assert unknown.json() == {"error": {"message": "The model 'org/other-model' does not exist",
                                        "type": "not_found_error", "param": "model", "code": 404}}
    assert "404" in contract["paths"]["/v1/models/{model_id}"]["get"]["responses"]
