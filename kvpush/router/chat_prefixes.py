"""A conversation's earlier turns tokenized once. The router tokenizes each chat's prompt
(its template's text) to size the reservation and name its blocks; a conversation's next
turn sends all of it again, so without this a 5,800-token history cost the router about
4 ms of CPU per turn to tokenize (measured), and the cost grows with the history.

Why a prefix's ids can be kept: a tokenizer takes its added special tokens out of the text
first and tokenizes the pieces between them each on its own. So the text cut just before
a special token tokenizes as its two parts do, one after the other, provided the token
cannot reach across the cut: it does not swallow the whitespace before it (lstrip), is not
matched only as a whole word or after normalization, and special tokens are not split into
ordinary ones (``encode_special_tokens``); ``split_tokens`` keeps only those that qualify,
and the tests hold the ids against the whole text's on random conversations. Chat
templates put such a token at the start of every message, so the text up to the last one
(the generation prompt) is kept, and the next turn, whose text begins with it, tokenizes
only its new messages.

Only the router's count and block keys come from here: the prompt decode continues from
is the prefill engine's own tokenization, so a mismatch would cost a recompute or a missed
overlap, never a wrong answer.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter, OrderedDict
from typing import Callable

from kvpush.router import metrics

# How many tokens of kept prefixes (with their text: about 8 bytes a token) a router
# worker holds, the least recently used dropped first.
KEPT_TOKENS = 2_000_000
_REUSED = metrics.CHAT_TOKENS.labels(how="reused")
_TOKENIZED = metrics.CHAT_TOKENS.labels(how="tokenized")


def split_tokens(added: dict, encode_special_tokens: bool) -> list[str]:
    """The added tokens a text may be cut before (``added``: the Rust tokenizer's
    ``get_added_tokens_decoder()``); none where special tokens are split into pieces."""
    if encode_special_tokens:
        return []
    return [t.content for t in added.values()
            if t.special and t.content and not (t.lstrip or t.single_word or t.normalized)]


class ChatPrefixes:
    """Token ids of templates' texts, their longest kept prefix reused (``ids``)."""

    def __init__(self, encode: Callable[[str], list[int]], split_before: list[str],
                 kept_tokens: int = KEPT_TOKENS) -> None:
        self._encode = encode  # a text's ids, no special tokens added
        self._cut = re.compile("|".join(map(re.escape, sorted(split_before, key=len, reverse=True))))
        self._kept: OrderedDict[str, array] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # of the kept prefixes, to try only the cuts that can match
        self._tokens = 0
        self.kept_tokens = kept_tokens

    def ids(self, text: str) -> list[int]:
        cuts = [m.start() for m in self._cut.finditer(text)]
        last = cuts[-1] if cuts else 0
        if last == 0:
            return self._encode(text)
        head, at = None, 0
        for cut in reversed(cuts):
            if cut in self._lengths and (head := self._kept.get(text[:cut])) is not None:
                at = cut
                self._kept.move_to_end(text[:cut])
                break
        if at != last:
            prefix = (head if head is not None else array("i")) + array("i", self._encode(text[at:last]))
            self._keep(text[:last], prefix)
        else:
            prefix = head
        rest = self._encode(text[last:])
        reused = len(head) if head is not None else 0
        _REUSED.inc(reused)
        _TOKENIZED.inc(len(prefix) - reused + len(rest))
        return prefix.tolist() + rest

    def _keep(self, prefix_text: str, ids: array) -> None:
        if len(ids) > self.kept_tokens or prefix_text in self._kept:
            return
        self._kept[prefix_text] = ids
        self._lengths[len(prefix_text)] += 1
        self._tokens += len(ids)
        while self._tokens > self.kept_tokens:
            text, old = self._kept.popitem(last=False)
            self._tokens -= len(old)
            self._lengths[len(text)] -= 1
            if not self._lengths[len(text)]:
                del self._lengths[len(text)]
