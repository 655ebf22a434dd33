"""The bodies the router sends its engines: decode's prompt written from the JSON text of
the prefill engine's answer (``first_token.IdsJson``), not encoded again, and read by an
engine as the same JSON."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.router.first_token import IdsJson, body_json, parse_head, prompt_json

values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 200_000), min_size=1, max_size=50),
       rest=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "prompt"), values, max_size=5),
       spaced=st.booleans())
def test_a_kept_prompt_reads_as_the_whole_body(ids, rest, spaced):
    prompt = IdsJson(ids)
    prompt.json = (", " if spaced else ",").join(map(str, ids))
    body = {"prompt": prompt, **rest}
    assert json.loads(body_json(body)) == {"prompt": ids, **rest}
    assert prompt.json in body_json(body)


def test_bodies_without_a_kept_prompt_are_plain_json():
    for body in ({"prompt": [1, 2]}, {"prompt": "text", "n": 1}, {"messages": []}, {"prompt": IdsJson([3])}):
        assert body_json(body) == json.dumps(body)


def test_the_prefill_answers_prompt_ids_as_written():
    completion = {"choices": [{"index": 0, "text": "a", "token_ids": [9], "prompt_token_ids": [5, 6, 7],
                               "finish_reason": "length"}], "usage": {}}
    payload = json.dumps(completion, separators=(",", ":")).encode()
    head = parse_head("completions", completion, payload)
    assert head.prompt_json == "5,6,7" and head.prompt_ids == [5, 6, 7]
    chat = {"choices": [{"index": 0, "message": {"content": "b"}, "token_ids": [9]}], "prompt_token_ids": [1, 2]}
    assert parse_head("chat", chat, json.dumps(chat, separators=(",", ":")).encode()).prompt_json == "1,2"
    # Not plainly there (written with spaces, by another encoder than vLLM's compact one),
    # or another list than the one parsed: the ids are encoded.
    assert parse_head("chat", chat, json.dumps(chat).encode()).prompt_json == ""
    assert prompt_json(b'{"prompt_token_ids":null}', [1]) == ""
    assert prompt_json(b'{"prompt_token_ids":[1,2]}', [1, 2, 3]) == ""
    assert prompt_json(b'{"prompt_token_ids":["a]"]}', ["a]"]) == ""
    assert prompt_json(b'{"prompt_token_ids":[1,-2]}', [1, -2]) == ""
    assert parse_head("completions", completion).prompt_json == ""
