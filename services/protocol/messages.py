"""Every message of the serving stack (KV events excepted: see kv_events.py).

Frozen msgspec Structs, msgpack on the wire, one tag each and a `version`. Who sends what:

    gateway   --Submit, Abort------------------------------> scheduler      (ZMQ PUSH/PULL)
    scheduler --Admitted, Rejected, RequestFailed, Moved---> gateway        (reply_addr; Moved: a request
                                                                              that runs again from its
                                                                              start, for its wait's timer)
    scheduler --Dispatch, Abort----------------------------> worker         (a prefill worker's Dispatch
                                                                              names the decode worker it
                                                                              hands the KV to)
    scheduler --AwaitKV, Abort-----------------------------> decode worker  (the request's KV comes from a
                                                                              prefill worker)
    scheduler --Abort, Migrate-----------------------------> detokenizer    (worker died or handed requests
                                                                              back: fail, or move the stream)
    detok     --Resume-------------------------------------> scheduler      (the tokens a moving stream has)
    worker    --StreamOpen, StepOutput, Abort--------------> detokenizer    (one connection: ordered; the
                                                                              gateway's inbox when it
                                                                              detokenizes itself)
    worker    --WorkerStatus-------------------------------> scheduler
    detok     --TextBatch, RequestFailed-------------------> gateway
    detok     --Abort--------------------------------------> scheduler      (stop string hit)
    gateway   --TokenizeRequest / TokenizeReply------------> tokenizer      (gRPC, same structs)

A request's id is assigned by the gateway and never comes from a client.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from services.protocol.sampling import MAX_LOGPROBS, MAX_PROMPT_LOGPROBS_TOKENS, SamplingParams

PROTOCOL_VERSION = 1
MAX_CONVERSATION_KEY = 64            # Submit.conversation: a hex digest, never the client's text
# a moving request's tokens (Dispatch.resume_output, Resume): per sample, at most a context's worth
SampleOutputs = Annotated[list[Annotated[list[int], msgspec.Meta(max_length=1 << 20)]], msgspec.Meta(max_length=1024)]
SampleIndices = Annotated[list[int], msgspec.Meta(max_length=1024)]
# a request's run: the scheduler numbers each dispatch of a request (a move is a new run; a re-run
# of a hand-off's prefill half on its decode worker is the same run). Workers echo it in their
# reports, so a late report of an earlier run on the same worker is told apart from the run now there.
Run = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
MAX_REPORTED = 1 << 16                 # request ids one WorkerStatus list may carry
ReportedIds = Annotated[list[str], msgspec.Meta(max_length=MAX_REPORTED)]
ReportedRuns = Annotated[list[Run], msgspec.Meta(max_length=MAX_REPORTED)]


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    version: int = PROTOCOL_VERSION


# ----------------------------------------------------------------------------- gateway -> scheduler


class Submit(Msg, tag="submit", kw_only=True):
    request_id: str
    tenant: str                      # server-assigned (API key index), never client text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0                # lower runs first (vLLM convention)
    cache_salt: str = ""
    reply_addr: str                  # gateway's ZMQ inbox
    detok_addr: str                  # detokenizer that streams this request's text
    arrival: float = 0.0             # gateway wall-clock time
    # the gateway's digest of (tenant, the client's `user` or `conversation_id`): the scheduler sends
    # the conversation's next turn where its last one ran; "" when the request named none
    conversation: Annotated[str, msgspec.Meta(max_length=MAX_CONVERSATION_KEY)] = ""
    # sent again by its gateway because the scheduler it went to stopped: it may be running on a
    # worker already (the new scheduler adopts it there) or nowhere (it moves, from its stream's tokens)
    resubmitted: bool = False


class Abort(Msg, tag="abort", kw_only=True):
    request_id: str
    index: int | None = None         # one sample (n > 1, e.g. its stop string matched); None: all
    # client | stop | worker_failed | timeout | shutdown | invalid_request | rate_limit_exceeded | moved
    reason: str = "client"


# ----------------------------------------------------------------------------- scheduler -> gateway


class Admitted(Msg, tag="admitted", kw_only=True):
    request_id: str
    worker_id: str = ""              # empty while queued


class Rejected(Msg, tag="rejected", kw_only=True):
    request_id: str
    status: int                      # HTTP status: 400, 429, 503
    code: str                        # OpenAI-style error code
    message: str
    retry_after_s: int = 0


class RequestFailed(Msg, tag="failed", kw_only=True):
    request_id: str
    status: int
    code: str
    message: str


class Moved(Msg, tag="moved", kw_only=True):
    """The request moved to another worker before its detokenizer saw it stream (its worker stopped
    before it opened the stream): it starts again there, and only its gateway, which holds its
    Submit's time, can time what that cost the client."""

    request_id: str


# why a request was aborted -> what its client is told (HTTP status, OpenAI error code, message)
_ABORT_ERRORS = {
    "worker_failed": (503, "worker_failed", "the worker serving this request stopped; please retry"),
    "timeout": (504, "timeout", "the request took too long and was stopped"),
    "shutdown": (503, "shutdown", "the service serving this request shut down; please retry"),
    "invalid_request": (400, "invalid_request", "the request's output constraint could not be compiled"),
    "rate_limit_exceeded": (429, "rate_limit_exceeded",
                            "the request's output constraint waited too long to compile behind this API key's "
                            "others; please retry"),
}
_ABORTED = (500, "aborted", "the request was stopped before it finished")


def failure_of(abort: Abort) -> RequestFailed:
    """The RequestFailed that ends a stream an Abort stopped: its client gets an error, not a hang
    (the gateway drops it when the abort was its own, its client having left)."""
    status, code, message = _ABORT_ERRORS.get(abort.reason, _ABORTED)
    return RequestFailed(request_id=abort.request_id, status=status, code=code, message=message)


# ----------------------------------------------------------------------------- scheduler -> worker


class Dispatch(Msg, tag="dispatch", kw_only=True):
    request_id: str
    epoch: int                       # the worker incarnation it is meant for; any other refuses it
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    reply_addr: str
    detok_addr: str
    # set on a prefill worker's Dispatch: the decode worker's KV-transfer address
    # (`tcp://host:port#worker`). The prefill worker computes the prompt, streams the first token,
    # hands the KV over there and the decode worker streams the rest.
    handoff_to: str = ""
    # the request's prefill worker died after it may have streamed first tokens: this worker runs it
    # whole again (same seed, so the same tokens) and its detokenizer skips what was streamed
    resumes: bool = False
    # a request moved off a worker that stopped (Migrate/Resume): each sample's tokens already
    # streamed, computed here as prefix and counted as output (budget, penalties, seeded draws
    # continue at their positions); samples in resume_ended are over. Empty: a fresh request.
    resume_output: SampleOutputs = []
    resume_ended: SampleIndices = []
    run: Run = 0                     # see `Run`; echoed in the worker's reports of this request
    # a peer move (with resume_output, every sample not ended having tokens): the drained worker
    # at this KV-transfer address's origin sends the KV of prompt + each such sample's tokens but
    # its last; this worker awaits it for the hand-off lease and decodes on from it, else
    # recomputes the request from resume_output as without it
    kv_from: str = ""


class AwaitKV(Msg, tag="await_kv", kw_only=True):
    """To a decode worker: a prefill worker will offer this request's KV (gpu_worker/kv_transfer);
    stream what follows the first token to detok_addr. Offers of requests not awaited are refused."""

    request_id: str
    epoch: int                       # the decode worker incarnation it is meant for
    n: int                           # samples (the Offer carries the rest of the request)
    reply_addr: str
    detok_addr: str
    run: Run = 0                     # the run of the prefill worker's Dispatch (`Run`)


class MoveKV(Msg, tag="move_kv", kw_only=True):
    """To a draining worker that holds a handed-back request's KV (WorkerStatus.kv_held): send it
    to the worker at `to` (its KV-transfer address), which awaits it (Dispatch.kv_from). Sent only
    when `output_token_ids` (the tokens the client has) are exactly the ones the KV was computed
    for; the worker checks that again and otherwise cancels the hand-off (the peer recomputes)."""

    request_id: str
    epoch: int                       # the draining worker's incarnation
    to: str                          # the peer's KV-transfer address (`tcp://host:port#worker`)
    output_token_ids: Annotated[list[int], msgspec.Meta(max_length=1 << 20)]   # sample 0's
    run: Run = 0                     # the peer's run of the request
    # n > 1: every sample's tokens its client has, and the samples that ended (Resume's)
    sample_outputs: SampleOutputs = []
    ended: SampleIndices = []


# ----------------------------------------------------------------------------- worker -> detokenizer


class StreamOpen(Msg, tag="open", kw_only=True):
    """Sent before the first StepOutput carrying the request, on the same connection."""

    request_id: str
    params: SamplingParams
    reply_addr: str
    num_prompt_tokens: int
    prompt_tail: list[int] = []      # last prompt ids: left context for the first generated token
    worker_addr: str = ""            # the worker's inbox: a gateway that makes the text stops samples there
    # a re-run of a stream whose first tokens came from a worker that died (Dispatch.resumes): the
    # detokenizer keeps the stream and drops as many leading tokens of each sample as it has seen
    resumes: bool = False
    # the worker (id, epoch) that opens the stream: a moved stream that left it earlier takes its
    # tokens again from here on (every late token of its earlier run came before, on this connection)
    worker_id: str = ""
    worker_epoch: int = -1


class PromptTokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One prompt token's logprob given the tokens before it (SamplingParams.prompt_logprobs);
    the prompt's first token has none (logprob and rank None, no top)."""

    token_id: int
    logprob: float | None
    rank: int | None                             # 1: the most likely token at its position
    top: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_LOGPROBS)] = []  # (id, logprob) best first


# a request's prompt logprobs: one entry per prompt token
PromptLogprobs = Annotated[list[PromptTokenLogprob], msgspec.Meta(max_length=MAX_PROMPT_LOGPROBS_TOKENS)]


class SeqTokens(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One sample's progress in one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None          # of each new token
    top: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) best first
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # on sample 0's first SeqTokens of a request that asked (params.prompt_logprobs). Last: older
    # peers ignore it.
    prompt_logprobs: PromptLogprobs | None = None


class StepOutput(Msg, tag="step", kw_only=True):
    """Every new token of one engine step (for one detokenizer)."""

    worker_id: str
    epoch: int
    step: int
    seqs: list[SeqTokens]


# ----------------------------------------------------------------------------- worker -> scheduler


class WorkerStatus(Msg, tag="wstatus", kw_only=True):
    worker_id: str
    epoch: int
    running: int
    waiting: int
    free_blocks: int
    cached_blocks: int
    total_blocks: int
    finished: ReportedIds = []       # requests that ended (any reason) since the last status
    active: ReportedIds | None = None  # heartbeat statuses: every request the worker holds (reconciliation)
    # a draining worker's requests it stopped and freed unfinished: the scheduler moves each elsewhere
    handed_back: ReportedIds = []
    # the run (Dispatch.run / AwaitKV.run) of each entry of `finished` / `active`, in the same order;
    # empty from a worker that does not number runs (then every report counts)
    finished_runs: ReportedRuns = []
    active_runs: ReportedRuns | None = None
    # a prefill worker's hand-offs that failed (the decode worker refused, failed or went silent)
    # and that it decodes itself, holding their KV and first tokens: the scheduler drops the decode
    # half; `kept_runs` as `finished_runs`
    kept: ReportedIds = []
    kept_runs: ReportedRuns = []
    # those of `handed_back` whose KV the draining worker holds for a peer, for its hand-off lease:
    # the scheduler may move them with their KV (MoveKV) instead of having them recomputed
    kv_held: ReportedIds = []


# ----------------------------------------------------------------------------- migration


class Migrate(Msg, tag="migrate", kw_only=True):
    """Scheduler -> the request's detokenizer: its worker stopped (died, or handed it back while
    draining). Answer with a Resume and take no more tokens of this request from that worker: the
    stream goes on from the tokens the detokenizer has."""

    request_id: str
    worker_id: str                   # the worker it leaves ("": whichever streamed it last, for a
                                     # scheduler that never knew where it ran)
    reply_addr: str                  # the scheduler's inbox
    worker_epoch: int = -1           # that worker's incarnation: a restart under the same id is a new
                                     # worker whose tokens count (-1: every incarnation is left)
    # the other half of a hand-off (told to drop the request, "moved"), left too: a prefill worker
    # that took its hand-off back streams on until that Abort reaches it ("": none)
    also_worker_id: str = ""
    also_worker_epoch: int = -1
    # False: no move, only "take no more tokens from worker_id" (a hand-off its prefill worker kept
    # and decodes itself: the decode worker, told to drop it, may have admitted it and stream a
    # step or two before that Abort lands); no Resume is sent back
    resume: bool = True


class Resume(Msg, tag="resume", kw_only=True):
    """Detokenizer -> scheduler: where a moving stream stands."""

    request_id: str
    output_token_ids: SampleOutputs     # per sample: the tokens its client has ([] for one not begun)
    ended: SampleIndices = []           # samples that ended
    known: bool = True                  # False: no such stream here (never opened, or already over)


# ----------------------------------------------------------------------------- detokenizer -> gateway


class TokenLogprobText(msgspec.Struct, frozen=True, array_like=True, gc=False):
    token: str
    logprob: float
    token_bytes: list[int]
    top: list[tuple[str, float, list[int]]] = []


class PromptLogprobText(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A prompt token's logprob with the text of it and its alternatives (vLLM's Logprob entries)."""

    token_id: int
    token: str
    logprob: float | None                      # None for the prompt's first token
    rank: int | None
    top: Annotated[list[tuple[int, str, float]], msgspec.Meta(max_length=MAX_LOGPROBS)] = []  # (id, text, logprob)


PromptLogprobTexts = Annotated[list[PromptLogprobText], msgspec.Meta(max_length=MAX_PROMPT_LOGPROBS_TOKENS)]


class TextDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprobText] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # what ended a "stop": the stop string that matched, or the stop_token_ids entry sampled;
    # None for EOS, length and abort (vLLM's stop_reason). Last, so older peers ignore it.
    stop_reason: str | int | None = None
    # one entry per prompt token, on sample 0's first delta of a request that asked (params.prompt_logprobs)
    prompt_logprobs: PromptLogprobTexts | None = None


class TextBatch(Msg, tag="text", kw_only=True):
    deltas: list[TextDelta]


# ----------------------------------------------------------------------------- gRPC: gateway -> tokenizer


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class TokenizeRequest(Msg, tag="tokenize", kw_only=True):
    prompt: str | None = None                 # completions: plain text
    prompt_token_ids: list[int] | None = None  # completions: ids given by the client (checked)
    messages: list[ChatMessage] | None = None  # chat: rendered with the model's template
    add_generation_prompt: bool = True
    tools: list[dict] | None = None           # chat: tool schemas the template may render
    add_special_tokens: bool = True           # plain prompts: bos/eos as the model's config asks
    max_prompt_tokens: int = 0                # the model's context length: longer prompts are refused (0: none)
    chat_template_kwargs: dict[str, Any] | None = None   # chat: extra template variables (enable_thinking...)
    bad_words: list[str] = []                 # SamplingParams.bad_words: encoded into the reply's bad_words_token_ids
    truncate_prompt_tokens: int = 0           # vLLM's: keep the prompt's last k tokens (-1: max_prompt_tokens; 0: all)
    continue_final_message: bool = False      # chat: the rendered prompt ends right after the last message's content
    chat_special_tokens: bool = False         # chat: the tokenizer's bos/eos too, on top of the template's (vLLM's add_special_tokens)


class TokenizeReply(Msg, tag="tokenized", kw_only=True):
    prompt_token_ids: list[int]
    detok_addr: str                           # where this tokenizer process detokenizes streams
    vocab_size: int
    bad_words_token_ids: list[list[int]] = []  # the request's bad_words, encoded (bad_words_token_ids())


class DetokenizeRequest(Msg, tag="detokenize", kw_only=True):
    token_ids: list[int]
    skip_special_tokens: bool = False
    token_strs: bool = False                  # also each id's own token string (the vocabulary's)


class DetokenizeReply(Msg, tag="detokenized", kw_only=True):
    text: str
    token_strs: list[str] | None = None


# ----------------------------------------------------------------------------- inbox unions

SchedulerInbox = Union[Submit, Abort, WorkerStatus, Resume]
WorkerInbox = Union[Dispatch, AwaitKV, Abort, MoveKV]
DetokInbox = Union[StreamOpen, StepOutput, Abort, Migrate]
# a gateway with --text-in-gateway is its requests' detokenizer too: it takes DetokInbox's messages
GatewayInbox = Union[Admitted, Rejected, RequestFailed, Moved, TextBatch, StreamOpen, StepOutput, Abort, Migrate]
