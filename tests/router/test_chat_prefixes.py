"""Chats' prompt ids with a conversation's earlier turns reused (``chat_prefixes``) against
the HF tokenizer's ids of the whole template text, turn after turn, with the tiny model's
tokenizer and chat template; the bound on what is kept; the rule on which special tokens a
text may be cut before, shown on a token that swallows the whitespace before it."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kvpush.app import engines
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.router.chat_prefixes import ChatPrefixes, split_tokens
from kvpush.router.tokens import HFTokenCounter

COUNTER = HFTokenCounter(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
HF = COUNTER._tok
PIECES = ["the KV", " is pushed", "é", "日本", "😀", "\n", "  ", " ", "<|user|>", "</s>", "<s>", "12", ".", "\t"]


def hf_ids(messages: list[dict]) -> list[int]:
    return list(HF.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def fresh(kept_tokens: int = 2_000_000) -> ChatPrefixes:
    rust = COUNTER._rust
    return ChatPrefixes(lambda text: rust.encode(text, add_special_tokens=False).ids,
                        split_tokens(rust.get_added_tokens_decoder(), rust.encode_special_tokens), kept_tokens)


def text_of(messages: list[dict]) -> str:
    return HF.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


contents = st.lists(st.sampled_from(PIECES), min_size=0, max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(system=st.one_of(st.none(), contents), turns=st.lists(st.tuples(contents, contents), min_size=1, max_size=6),
       kept=st.sampled_from([2_000_000, 40]))
def test_each_turn_has_the_whole_texts_ids(system, turns, kept):
    prefixes = fresh(kept)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        assert prefixes.ids(text_of(messages)) == hf_ids(messages)
        messages.append({"role": "assistant", "content": answer})
    assert prefixes._tokens <= kept


def test_a_long_conversations_next_turn_tokenizes_only_what_is_new():
    prefixes = fresh()
    messages = [{"role": "system", "content": "Be brief. " * 50}]
    for turn in range(8):
        messages.append({"role": "user", "content": f"Question {turn}: where does the KV go? " * 20})
        reused_before, tokenized_before = reused(), tokenized()
        ids = prefixes.ids(text_of(messages))
        assert ids == hf_ids(messages)
        if turn:
            # What the turn before kept: its prompt less the generation prompt (2 tokens);
            # the rest (the last answer, the new question, the generation prompt) is new.
            kept = len(hf_ids(messages[:-2])) - 2
            assert reused() - reused_before == kept
            assert tokenized() - tokenized_before == len(ids) - kept
        messages.append({"role": "assistant", "content": f"Answer {turn}: into blocks reserved on decode. " * 10})


def test_what_is_kept_is_bounded_least_recent_first():
    prefixes = fresh(kept_tokens=500)
    conversations = [[{"role": "user", "content": f"conversation {c} " * 40}] for c in range(8)]
    for messages in conversations:
        assert prefixes.ids(text_of(messages)) == hf_ids(messages)
    assert 0 < prefixes._tokens <= 500
    assert sum(prefixes._lengths.values()) == len(prefixes._kept)
    cut = text_of(conversations[0]).rindex("<|assistant|>")
    assert text_of(conversations[-1])[:cut] in prefixes._kept
    assert text_of(conversations[0])[:cut] not in prefixes._kept


def test_a_token_that_swallows_whitespace_before_it_is_not_cut_before():
    """Cut before such a token, the two parts tokenize differently from the whole: the
    whitespace goes into the token in the whole text, not in the first part."""
    vocab = {"[UNK]": 0, "a": 1, " ": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    tok.add_special_tokens([AddedToken("<L>", lstrip=True, special=True), AddedToken("<P>", special=True)])
    whole = tok.encode("a <L>a", add_special_tokens=False).ids
    parts = tok.encode("a ", add_special_tokens=False).ids + tok.encode("<L>a", add_special_tokens=False).ids
    assert whole != parts
    assert split_tokens(tok.get_added_tokens_decoder(), False) == ["<P>"]
    assert split_tokens(tok.get_added_tokens_decoder(), True) == []
    texts = ("a <P>a <L>a", "a <P>a <L>a <P>a", "a <P>a <L>a <P>a <L>")
    prefixes = ChatPrefixes(lambda t: tok.encode(t, add_special_tokens=False).ids, ["<P>"])
    assert [prefixes.ids(t) for t in texts] == [tok.encode(t, add_special_tokens=False).ids for t in texts]
    cutting_both = ChatPrefixes(lambda t: tok.encode(t, add_special_tokens=False).ids, ["<P>", "<L>"])
    assert [cutting_both.ids(t) for t in texts] != [tok.encode(t, add_special_tokens=False).ids for t in texts]


def reused() -> float:
    from kvpush.router.metrics import REGISTRY
    return REGISTRY.get_sample_value("kvpush_router_chat_tokens_total", {"how": "reused"}) or 0.0


def tokenized() -> float:
    from kvpush.router.metrics import REGISTRY
    return REGISTRY.get_sample_value("kvpush_router_chat_tokens_total", {"how": "tokenized"}) or 0.0
