"""Every HTTP answer the API gives, counted by status class: an operator's error rate in /metrics
(`vlamux_http_responses`), and a soak's proof that nothing answered 5xx."""

from __future__ import annotations

import threading
from collections import Counter

CLASSES = ("2xx", "3xx", "4xx", "5xx")


class ResponseCounts:
    """ASGI middleware, outermost: it sees every answer, the admission's refusals included."""

    def __init__(self, app, counts: Counter, lock: threading.Lock):
        self.app, self.counts, self.lock = app, counts, lock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                with self.lock:
                    self.counts[f"{int(message['status']) // 100}xx"] += 1
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # the server answers it with a 500
                with self.lock:
                    self.counts["5xx"] += 1
            raise
