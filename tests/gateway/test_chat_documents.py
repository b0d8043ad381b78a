"""vLLM's ``documents`` chat field: the documents reach the model's template (RAG templates,
Command-R's and Granite's, render them), on /v1/chat/completions and /tokenize alike; bad ones
are refused naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.gateway.served_model import ServedModel
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    module_gateway_client,  # noqa: F401 - the http fixture
    post_json,
    script_answer,
)

pytestmark = pytest.mark.timeout(120)

RAG_TEMPLATE = (
    "{% if documents %}{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n"
    "{% endfor %}{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
DOCUMENTS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "Nice", "text": "Nice is on the Riviera."},
]


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    served.tokenizer.chat_template = RAG_TEMPLATE
    return served


def test_documents_reach_the_template(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    script_answer(cluster, model, "Paris.")
    post_json(http, "/v1/chat/completions", {"messages": [USER_HI], "documents": DOCUMENTS})
    text = model.tokenizer.decode(cluster.prompts[-1])
    assert text.startswith("[Paris] Paris is the capital of France.\n[Nice] Nice is on")
    assert text.endswith("user: hi\nassistant:")
    tokenized = post_json(http, "/tokenize", {"messages": [USER_HI], "documents": DOCUMENTS})
    assert tokenized["tokens"] == cluster.prompts[-1]
    post_json(http, "/v1/chat/completions", {"messages": [USER_HI]})
    assert model.tokenizer.decode(cluster.prompts[-1]) == "user: hi\nassistant:"


@pytest.mark.parametrize(
    ("documents", "param"),
    [
        ({"title": "x"}, "documents"),
        ([DOCUMENTS[0], "text"], "documents[1]"),
        ([{}], "documents[0]"),
        ([{"title": "x", "text": 3}], "documents[0].text"),
        ([{"text": "x" * 20_000}], "documents"),  # far beyond the context
    ],
)
def test_bad_documents_are_refused_naming_the_field(
    http: httpx.Client, documents: Any, param: str
) -> None:
    body = {"messages": [USER_HI], "documents": documents}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
