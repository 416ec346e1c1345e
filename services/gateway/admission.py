"""How much generation the gateway has under way, and the bound past which it says no at once.

Every sampling request (an OpenAI completion, a Tinker ``asample``) takes a :class:`Ticket`
before anything is sent to inference and gives it back when its answer (or its failure) is in.
The gateway holds at most ``max_inflight_requests`` of them, across every tenant, and at most
``max_inflight_tokens`` tokens to generate among them (prompts x n x max_tokens each). One more
is answered at once with a 429 and ``Retry-After: retry_after_s``, in the API's own error shape:
a request waits in no queue here, so a burst far above the bound costs the gateway a refusal
per request, and the requests admitted finish as they would alone. (A single request bigger than
``max_inflight_tokens`` is still admitted when nothing else is under way: ``max_request_tokens``
bounds each request.) Inference has a bound of its own per replica, which answers ``overloaded``;
the gateway turns that into the same 429.
"""

from __future__ import annotations

from services.gateway.errors import GatewayError


class Ticket:
    """One admitted request's share of the bound; :meth:`release` gives it back (once)."""

    def __init__(self, admission: Admission, tokens: int) -> None:
        self._admission = admission
        self.tokens = tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back(self.tokens)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class Admission:
    """The gateway's generation under way, against its bound (see the module docstring)."""

    def __init__(self, max_requests: int, max_tokens: int, retry_after_s: float) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.retry_after_s = retry_after_s
        self.requests = 0
        self.tokens = 0
        self.refused = 0

    def admit(self, num_prompts: int, n: int, max_tokens: int) -> Ticket:
        """A ticket for a request of this size; a 429 GatewayError past the bound."""
        work = num_prompts * n * max_tokens
        if self.requests >= self.max_requests or (
            self.requests and self.tokens + work > self.max_tokens
        ):
            self.refused += 1
            raise GatewayError(
                429,
                f"this gateway is generating for {self.requests} requests ({self.tokens} tokens), "
                f"its bound (max_inflight_requests = {self.max_requests}, max_inflight_tokens = "
                f"{self.max_tokens}); retry after {self.retry_after_s:g}s",
                "overloaded",
                retry_after=self.retry_after_s,
            )
        self.requests += 1
        self.tokens += work
        return Ticket(self, work)

    def _give_back(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens
