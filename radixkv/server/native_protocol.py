"""The wire format of SGLang's ``POST /generate`` (its 0.5.23 fields): the request body and
its ``sampling_params`` as msgspec Structs, SGLang's defaults and limits, and the fields radixkv
refuses when they are set (:data:`REFUSED`) or accepts and ignores (operational ones).
native_plan.py turns a decoded request into engine requests; native.py serves the routes."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from radixkv.server import protocol as P

SGLANG_VERSION = "0.5.23"  # whose wire formats these are
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
GREEDY_BELOW = 1e-6  # SGLang samples greedily below this temperature

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class NativeSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``sampling_params`` object (its ``SamplingParams`` contract: unknown keys are
    refused). null means the default, as in SGLang, except ``max_new_tokens``: null there is
    "up to the context length"."""

    max_new_tokens: NonNegative | None = DEFAULT_MAX_NEW_TOKENS
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegative] | None = None
    stop_regex: str | list[str] | None = None  # refused when set
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # -1 (or the vocabulary or more): all tokens
    min_p: Probability | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: (
        Annotated[float, msgspec.Meta(gt=0.0, le=P.MAX_REPETITION_PENALTY)] | None
    ) = None
    min_new_tokens: NonNegative | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=P.MAX_N)] | None = None
    beam_width: int | None = None  # > 1: beam search, ``n`` of its hypotheses returned
    json_schema: str | dict[str, Any] | None = None  # "$$ANY$$": any JSON value
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # refused when set
    choice: list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None  # accepted; decoding ignores it
    no_stop_trim: bool | None = None
    stream_interval: int | None = None  # operational: every output is streamed
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    sampling_seed: Annotated[int, msgspec.Meta(ge=0, le=P.MAX_SEED)] | None = None
    custom_params: Any = None  # for custom logit processors, which are refused: unused
    watermark: Any = None  # refused when enabled


SAMPLING_FIELDS = tuple(NativeSamplingParams.__struct_fields__)
GUIDED_FIELDS = ("json_schema", "regex", "ebnf", "choice")


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``POST /generate`` body (``GenerateReqInput``). Fields past the first group
    are accepted only unset (see ``REFUSED``) or are operational and ignored."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    lora_path: str | list[str | None] | None = None
    cache_salt: str | list[str] | None = None
    extra_key: str | list[str] | None = None
    priority: int | None = None
    return_prompt_token_ids: bool = False
    # with return_logprob: these ids' logprobs at every position (one list, or one per prompt)
    token_ids_logprob: list[Any] | None = None
    # refused when set: radixkv cannot honour them
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    return_indexer_topk: Any = None
    return_entropy: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    watermark: Any = None
    # operational (routing, disaggregation, logging, media options without media): ignored
    session_id: Any = None
    lora_id: Any = None
    log_metrics: Any = None
    modalities: Any = None
    sampling_logprobs_mode: Any = None
    routed_experts_start_len: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    http_worker_ipc: Any = None
    background: Any = None
    no_logs: Any = None
    custom_labels: Any = None
    return_bytes: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    kv_hints: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None


# field -> why it is refused when set
REFUSED = {
    "input_embeds": "radixkv takes text or input_ids",
    "image_data": "radixkv serves text-only models",
    "video_data": "radixkv serves text-only models",
    "audio_data": "radixkv serves text-only models",
    "return_hidden_states": "hidden states are not returned",
    "return_routed_experts": "the experts each token was routed to are not returned",
    "return_indexer_topk": "radixkv has no sparse-attention indexer",
    "return_entropy": "entropies are not returned",
    "return_sampling_mask": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_output_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_top_logprobs_b64": "top logprobs come as nested lists only",
    "session_params": "sessions are not supported (the prefix cache reuses earlier turns)",
    "custom_logit_processor": "custom logit processors are not supported",
    "positional_embed_overrides": "embedding overrides are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "require_reasoning": "reasoning control is not supported on /generate",
    "max_thinking_tokens": "thinking budgets are not supported",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "token_indices_to_pool": "pooled readout is not supported",
    "watermark": "watermarking is not supported",
}


def is_set(value: Any) -> bool:
    """Whether a refused field asks for something: not null, false, empty, or a list of those
    (a batch's per-prompt values); a watermark only when enabled."""
    if value is None or value is False:
        return False
    if isinstance(value, list):
        return any(is_set(v) for v in value)
    if isinstance(value, dict):
        return bool(value) and value.get("enabled", True) is not False
    if isinstance(value, str):
        return bool(value)
    return True


class UpdateWeightsFromDiskRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``POST /update_weights_from_disk`` body (``UpdateWeightFromDiskReqInput``):
    a checkpoint folder (or Hub repo id) of the served architecture. ``abort_all_requests``:
    end the requests in flight (else they are retracted and recomputed under the new weights:
    ``num_paused_requests`` in the answer). ``flush_cache`` must stay true (radixkv never
    serves KV computed under other weights); ``load_format`` may be safetensors or auto."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    # SGLang's, operational: the update always completes before the answer
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
