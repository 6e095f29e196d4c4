"""``POST /v1/score`` (SGLang's scoring API): each item's label probabilities after the query.

Every item becomes one engine request of one greedy token whose logprobs entry carries the
labels (engine/scoring.py builds the prompts and reads the scores); with the query first, the
prefix cache computes the query once for all items. The request is validated whole (the
protocol, the model, every prompt's length and ids, the labels against the vocabulary) before
any item runs, is admitted as one sequence per item (``max_queue``), and releases everything
however it ends: a client that leaves aborts the items still running.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request, Response

from radixkv.engine.scoring import label_scores, score_params, score_prompts
from radixkv.server import openapi as OA
from radixkv.server import protocol as P
from radixkv.server import render as R
from radixkv.server.state import ServerState
from radixkv.server.submission import Submission
from radixkv.server.transport import ClientGone, read_body, wait_or_disconnect

__all__ = ["add_score_route"]


def add_score_route(app: FastAPI, st: ServerState) -> None:
    @app.post(
        "/v1/score",
        openapi_extra=OA.json_route(
            "ScoreRequest",
            "ScoreResponse",
            "Each item's label-token probabilities after the query (SGLang's /v1/score)",
            runs_engine=True,
        ),
    )
    async def score(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        req = st.decode(await read_body(request, st.config.max_body_bytes), P.ScoreRequest)
        lora = st.check_model(req.model)
        st.check_ids(req.label_token_ids, "label_token_ids")
        params = score_params(req.label_token_ids)  # the decoder checked what it refuses
        prompts: list[Any] = score_prompts(req.query, req.items, item_first=req.item_first)
        ids = [
            st.prompt_ids(p) if isinstance(p, str) else st.check_ids(p, "items") for p in prompts
        ]
        for p in ids:
            st.check_length(p, params.max_tokens, "items")
        slot = st.admit(
            len(ids),
            len(ids),
            1,
            "items",
            tenant=principal.tenant,
            prompt_tokens=sum(map(len, ids)),
        )
        try:
            sub = Submission(
                st.engine,
                ids,
                params,
                namespace=principal.namespace(req.cache_salt),
                request_id=f"score-{uuid.uuid4().hex}",
                lora=lora,
                tenant=slot.tenant,
                on_start=slot.started,
            )
            slot.subs.append(sub)
            err = await wait_or_disconnect(sub.wait_finished(), request.receive)
            if err is not None:
                raise st.submission_error(err, None, lora)
            scores = []
            for i, p in enumerate(sub.prompts):
                R.take_deltas(sub, i, st.metrics)
                out = p.latest
                assert out is not None and out.outputs[0].logprobs
                entry = out.outputs[0].logprobs[0]
                scores.append(label_scores(entry, params.logprob_token_ids, req.apply_softmax))
            usage = P.make_usage(sub.prompt_tokens, len(ids), sub.cached_tokens)
            body = P.ScoreResponse(scores, req.model, usage)
            return Response(P.encode(body), media_type="application/json")
        except ClientGone:
            st.metrics.count_client_closed("waiting")
            return Response(status_code=499)  # nobody is listening; the items were aborted
        finally:
            await slot.release()
