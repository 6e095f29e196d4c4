"""Per-tenant admission limits: one tenant (API key) cannot take the whole server.

The server counts each tenant's sequences (a request's prompts x ``n``) from admission until
they end, as *waiting* until their prompt's first output comes back and *running* after; and
each tenant's *queued prompt tokens* (the prompts of its waiting sequences, once per prompt).
A request that would take its tenant past a limit is refused before anything is submitted,
with 429, a ``Retry-After`` header and a message and ``code`` naming the limit:

- ``tenant_max_prompts``: sequences in one request (prompts x ``n``); retrying the same request
  will not help (the message says to split it);
- ``tenant_max_waiting``: the tenant's waiting sequences, the new ones included;
- ``tenant_max_queued_tokens``: the tenant's queued prompt tokens, the new ones included.

How many of a tenant's sequences *run* at once is the engine's to cap
(``EngineConfig.tenant_max_running``, ``--tenant-max-running``): more wait their turn, and
count against ``tenant_max_waiting``. Which tenant's waiting request is admitted next is the
engine's fair admission (engine/schedule_policy.py). The server-wide ``max_queue`` (503 for
everyone) still bounds all tenants together; these limits keep one tenant from reaching it.

Not thread-safe: counted from the event loop only (``load`` may be read from anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.server.errors import APIError

# seconds a refused client is told to wait: a waiting sequence of radixkv's usual sizes starts
# or ends within about that long once others finish
RETRY_AFTER_S = 1

LIMIT_NAMES = ("tenant_max_prompts", "tenant_max_waiting", "tenant_max_queued_tokens")


@dataclass
class TenantLoad:
    """One tenant's sequences in flight and the prompt tokens of those still waiting."""

    waiting: int = 0
    running: int = 0
    queued_tokens: int = 0

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.queued_tokens)


@dataclass(frozen=True)
class TenantLimitValues:
    """The limits in force (None: no limit)."""

    max_prompts: int | None
    max_waiting: int | None
    max_queued_tokens: int | None


class TenantLimitExceeded(APIError):
    """A 429 naming the limit (``limit``, also the error's ``code``) and the tenant's load."""

    def __init__(self, limit: str, message: str, param: str | None = None) -> None:
        super().__init__(
            429, message, param=param, code=limit, headers={"retry-after": str(RETRY_AFTER_S)}
        )
        self.limit = limit


class TenantLimiter:
    """Counts each tenant's load and refuses what would exceed its limits."""

    def __init__(self) -> None:
        self._load: dict[str, TenantLoad] = {}

    def load(self) -> dict[str, TenantLoad]:
        """A copy of every tenant's load that is not zero (a snapshot: ``list`` copies the items
        in one step, so another thread, a benchmark's or a test's, may call it too)."""
        items = list(self._load.items())
        return {t: TenantLoad(v.waiting, v.running, v.queued_tokens) for t, v in items}

    def admit(
        self,
        tenant: str,
        limits: TenantLimitValues,
        *,
        seqs: int,
        prompts: int,
        n: int,
        tokens: int,
        param: str,
    ) -> TenantTicket:
        """Count a request's ``seqs`` sequences (``prompts`` prompts of ``tokens`` tokens in
        all, ``n`` samples each, as the messages say) as waiting, or raise
        :class:`TenantLimitExceeded` (``param``: the request field the prompts come from) and
        count nothing."""
        load = self._load.get(tenant) or TenantLoad()
        if limits.max_prompts is not None and seqs > limits.max_prompts:
            raise TenantLimitExceeded(
                "tenant_max_prompts",
                f"This request has {seqs} sequences ({prompts} prompts x n={n}), more "
                f"than one request of a tenant may have (tenant_max_prompts="
                f"{limits.max_prompts}); split it into smaller requests",
                param,
            )
        if limits.max_waiting is not None and load.waiting + seqs > limits.max_waiting:
            raise TenantLimitExceeded(
                "tenant_max_waiting",
                f"Too many requests waiting for this API key: {load.waiting} sequences waiting "
                f"and {load.running} running, this request adds {seqs} (tenant_max_waiting="
                f"{limits.max_waiting}); retry when some have started",
            )
        if (
            limits.max_queued_tokens is not None
            and load.queued_tokens + tokens > limits.max_queued_tokens
        ):
            raise TenantLimitExceeded(
                "tenant_max_queued_tokens",
                f"Too many prompt tokens queued for this API key: {load.queued_tokens} waiting, "
                f"this request adds {tokens} (tenant_max_queued_tokens="
                f"{limits.max_queued_tokens}); retry when some have started",
            )
        load.waiting += seqs
        load.queued_tokens += tokens
        self._load[tenant] = load
        return TenantTicket(self, tenant, seqs, tokens)

    def shift(self, tenant: str, waiting: int, running: int, tokens: int) -> None:
        """Add these (signed) counts to ``tenant``'s load (its tickets call it)."""
        load = self._load[tenant]
        load.waiting += waiting
        load.running += running
        load.queued_tokens += tokens
        assert load.waiting >= 0 and load.running >= 0 and load.queued_tokens >= 0, load
        if load.idle:
            del self._load[tenant]


class TenantTicket:
    """One request's count in its tenant's load: ``started`` moves a prompt's sequences from
    waiting to running, ``release`` takes what is left away (once, however often called)."""

    def __init__(self, limiter: TenantLimiter, tenant: str, seqs: int, tokens: int) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self._waiting = seqs
        self._running = 0
        self._tokens = tokens
        self._released = False

    def started(self, seqs: int, tokens: int) -> None:
        """A prompt of ``tokens`` tokens with ``seqs`` sequences produced its first output."""
        if self._released:
            return
        seqs, tokens = min(seqs, self._waiting), min(tokens, self._tokens)
        self._waiting -= seqs
        self._running += seqs
        self._tokens -= tokens
        self._limiter.shift(self.tenant, -seqs, seqs, -tokens)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._limiter.shift(self.tenant, -self._waiting, -self._running, -self._tokens)
