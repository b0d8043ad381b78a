"""The gateway's per-request tracker: order, exactly-once delivery, resume."""

from dataclasses import replace

from engine.messages import GenerateRequest, RequestFailure, TokenEvent
from engine.sampling.params import SamplingParams
from router.request_tracker import ClientItem, RequestDone, RequestTracker


def tracker(n: int = 1) -> tuple[RequestTracker, list[ClientItem]]:
    items: list[ClientItem] = []
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(n=n, max_tokens=5), "g")
    return RequestTracker(request, items.append, "p0", "d0"), items


def ev(pos: int, token: int, sample: int = 0, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", sample, pos, token, None, finish)


def test_events_pass_in_order_once() -> None:
    t, items = tracker()
    for event in [ev(0, 10), ev(2, 12), ev(1, 11), ev(1, 11), ev(0, 10), ev(3, 13, finish="stop")]:
        t.accept(event)
    tokens = [i.token_id for i in items if isinstance(i, TokenEvent)]
    assert tokens == [10, 11, 12, 13]
    assert items[-1] == RequestDone("r")
    t.accept(ev(4, 14))
    assert len(items) == 5  # nothing after the end


def test_request_is_done_when_every_sample_finished() -> None:
    t, items = tracker(n=2)
    t.accept(ev(0, 1, sample=0, finish="length"))
    assert not t.done
    t.accept(ev(0, 2, sample=1))
    t.accept(ev(1, 3, sample=1, finish="stop"))
    assert t.done and items[-1] == RequestDone("r")


def test_resume_request_carries_delivered_tokens_of_unfinished_samples() -> None:
    t, _ = tracker(n=2)
    t.accept(ev(0, 7, sample=0, finish="stop"))
    t.accept(ev(0, 8, sample=1))
    t.accept(ev(1, 9, sample=1))
    assert t.resume_request().resume_token_ids == {1: [8, 9]}


def test_resume_request_keeps_the_rest_of_the_request() -> None:
    """Its tenant's salt and its scheduling priority above all (the priority was dropped)."""
    items: list[ClientItem] = []
    request = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=5), "g", "salt", priority=4)
    t = RequestTracker(request, items.append, "p0", "d0")
    t.accept(ev(0, 7))
    assert t.resume_request() == replace(request, resume_token_ids={0: [7]})


def test_failure_closes_once() -> None:
    t, items = tracker()
    t.fail("boom")
    t.fail("again")
    assert items == [RequestFailure("r", "boom")]
