"""Where routing tokenization happens: the ingress turns an HTTP request into page hashes.

The ingress holds the *same tokenizer* as the engine replicas (loaded from the same model name
or folder) and computes, for each request, exactly the token ids the replica's server app will
compute (completions: ``tokenizer.encode(prompt)`` or the given ids; chat, responses without
``previous_response_id`` and Anthropic messages, as the chat they run as:
:func:`~radixkv.model.tokenizer.encode_chat`, the one chat path; scoring: its first item's
prompt, which starts with the query every item shares) and the namespace it will use (the
authenticated tenant plus ``cache_salt``; for a request naming a LoRA adapter as its ``model``,
that namespace inside the adapter's, ``AdapterNamespace``, keyed by the digest of the adapter's
files, which the ingress computes from the same ``lora_modules``). Their chained page hashes
(:func:`radixkv.cache.hashing.page_hashes`, Dynamo-compatible) travel with the forwarded
request as the router's hint. The replica tokenizes again for its engine (the request is
forwarded unchanged); tokenizing is microseconds per kilobyte, far below a prefill.

Anything the ingress cannot parse gets no hint (it is forwarded anyway and the replica answers
with its usual 400/401): routing never rejects a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.cache.hashing import page_hashes
from radixkv.engine.lora import AdapterNamespace
from radixkv.engine.scoring import score_prompts
from radixkv.model.tokenizer import encode_chat
from radixkv.server import protocol as P
from radixkv.server.auth import Authenticator
from radixkv.server.errors import APIError
from radixkv.server.messages import MessagesRequest, to_chat
from radixkv.server.responses import ResponsesRequest


def load_tokenizer(model: str, **source: Any) -> Any:
    """The tokenizer the engine would load for ``model`` (no weights are loaded); ``source``:
    the engine's ``revision``, ``tokenizer`` and ``chat_template`` overrides."""
    from radixkv.model.loader import load_tokenizer as load

    return load(model, **source)


@dataclass(frozen=True)
class RoutingHint:
    """What the router needs from a request (plain data, pickled by Ray)."""

    hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0
    stream: bool = False


class PromptHasher:
    """``hint(path, authorization, body) -> RoutingHint`` (see the module doc)."""

    def __init__(
        self,
        tokenizer: Any,
        page_size: int,
        *,
        api_keys: dict[str, str] | None = None,
        admin_key: str | None = None,
        keys_file: str | None = None,
        lora_digests: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.tokenizer = tokenizer
        self.page_size = page_size
        # adapter name -> content digest (radixkv.model.lora.adapter_digest) of the adapters
        # the replicas load: requests naming one are hashed in its namespace, as cached
        self.lora_digests = dict(lora_digests or {})
        # with ``keys_file`` the tenants follow the file as the replicas' servers do, so a new
        # key's requests are hashed in its tenant's namespace without a restart
        self.auth = Authenticator(api_keys, admin_key, keys_file=keys_file)

    def token_ids(self, path: str, body: bytes) -> tuple[list[int], Any] | None:
        """(prompt token ids, decoded request), or None when it is not a generation request
        the replica would accept."""
        try:
            if path == "/v1/completions":
                req: Any = P.decode_request(body, P.CompletionRequest)
                prompts = req.prompts()
                if not prompts:
                    return None
                first = prompts[0]  # a batch is routed by its first prompt
                ids = list(self.tokenizer.encode(first)) if isinstance(first, str) else first
                return ids, req
            if path == "/v1/score":  # every item's prompt starts with the query (or its item)
                sreq = P.decode_request(body, P.ScoreRequest)
                first = score_prompts(sreq.query, sreq.items, item_first=sreq.item_first)[0]
                ids = list(self.tokenizer.encode(first)) if isinstance(first, str) else first
                return ids, sreq
            if path == "/v1/messages":  # Anthropic's: the chat it runs as
                req = to_chat(P.decode_request(body, MessagesRequest))
            elif path == "/v1/responses":
                rreq = P.decode_request(body, ResponsesRequest)
                if rreq.previous_response_id is not None:
                    return None  # its conversation is stored on a replica, not known here
                req = rreq.chat_request([])  # a response runs as this chat
            elif path == "/v1/chat/completions":
                req = P.decode_request(body, P.ChatCompletionRequest)
            else:
                return None
            ids = encode_chat(
                self.tokenizer,
                req.template_messages(),
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            return ids, req
        except (P.ProtocolError, APIError, ValueError, TypeError):
            return None

    def hint(self, path: str, authorization: str | None, body: bytes) -> RoutingHint:
        got = self.token_ids(path, body)
        if got is None:
            return RoutingHint()
        ids, req = got
        try:
            namespace = self.auth.authenticate(authorization).namespace(req.cache_salt)
        except APIError:
            return RoutingHint(stream=bool(getattr(req, "stream", False)))
        digest = self.lora_digests.get(req.model)
        if digest is not None:
            namespace = AdapterNamespace(digest, namespace)
        return RoutingHint(
            hashes=page_hashes(ids, self.page_size, namespace),
            num_tokens=len(ids),
            stream=bool(getattr(req, "stream", False)),  # /v1/score has no stream
        )
