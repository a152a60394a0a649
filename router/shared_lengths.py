"""Finished requests' output lengths, learned from every router (issue 28).

A router's output predictor (router/predictors.py) learns from the lengths its own
responses report. With N routers each would learn from 1/N of the traffic, and predict
worse the more routers there are. So each router posts the lengths it saw last with its
report to the router board (router/peers.py), and its predictor also learns the ones the
other routers posted, about one poll interval late. The lengths are numbered per
router, so a length read twice is learned once; a router that restarts is a new router
(a new replica id).
"""

from __future__ import annotations

from collections import deque

from blockserve.protocol.router_policies import OutputPredictor

# The lengths a router posts: its latest finished requests. More finish between two posts
# only above this many per poll interval, and the oldest of them are then not heard.
POSTED_LENGTHS = 256


class SharedLengths:
    def __init__(self, predictor: OutputPredictor, posted: int = POSTED_LENGTHS) -> None:
        self.predictor = predictor
        self._own: deque[tuple[int, int, str, int]] = deque(maxlen=posted)
        self._finished = 0  # requests finished here: the next one's number
        self._heard: dict[str, int] = {}  # router -> the highest number learned from it
        self.heard = 0  # lengths learned from the other routers (for /admin/state)

    def learn(self, prompt_tokens: int, tenant: str, output_tokens: int) -> None:
        """A request finished at this router."""
        self.predictor.on_finished(prompt_tokens, tenant, output_tokens)
        self._own.append((self._finished, prompt_tokens, tenant, output_tokens))
        self._finished += 1

    def posted(self) -> list[tuple[int, int, str, int]]:
        """What this router posts: (number, prompt tokens, tenant, output tokens)."""
        return list(self._own)

    def hear(self, others: dict[str, list]) -> None:
        """Learn what the other live routers posted that was not learned yet."""
        for router, lengths in others.items():
            last = self._heard.get(router, -1)
            for number, prompt_tokens, tenant, output_tokens in lengths:
                if number > last:
                    self.predictor.on_finished(prompt_tokens, tenant, output_tokens)
                    self.heard += 1
                    last = number
            self._heard[router] = last
