"""Command-line client: stream a generation from the `ensemble` or `llm` model over tritonclient gRPC.

    python -m client "Tell me a story" [--model ensemble|llm] [--url localhost:8001]
        [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]
        [--stop STR ...] [--n N] [--chat] [--system TEXT] [--json-params '{"ignore_eos": true}']
        [--no-stream] [--ids] [--stats] [--tokenizer-path models/demo] [--timeout S] [--abort-model llm]

Text is printed as it arrives. With `--model ensemble` the server tokenizes and detokenizes.
With `--model llm` (the engine alone) the prompt is tokenized here with `backend.tokenizer`, and
each response's detokenization window is decoded here with `backend.detokenizer` exactly as the
postprocessing model would (`--ids` prints the token ids instead). `--stats` prints the finish
reason, token counts, time to first token, inter-token latency and tokens/s to stderr.
`--system` needs `--chat` (it is the chat's system message).

Ctrl-C, an error or no response within `--timeout` seconds cancels the request and also aborts
it on the engine model (`--abort-model`, default llm): Triton 2.51 does not pass an ensemble's
cancellation on to the running llm step (see client/triton_stream.py).

With n > 1 the samples' responses interleave on the stream; they are told apart by the sample
index each response carries (meta_info "index"), and printed as one `[sample i]` block per
sample, in index order (see N_HELP, the end of --help); `--stats` gives a line per sample and a
total.

Library use:

    from client.cli import stream_text, generate_text
    for piece in stream_text("Hello", max_tokens=16, temperature=0):
        print(piece, end="", flush=True)
    result = generate_text("Hello", model="llm", max_tokens=16, temperature=0)
    result.text, result.token_ids, result.finish_reason, result.ttft_s
    # n > 1: one GenerateResult per sample, by index (stream_pieces' pieces carry `.index`)
    [s.text for s in generate_text("Hello", max_tokens=16, json_params={"n": 2}).samples]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from client.triton_stream import TritonStreamClient

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = os.environ.get("LLM_MODEL_PATH", str(REPO_ROOT / "models" / "demo"))
MODELS = ("ensemble", "llm")


# meta_info lists a streamed response gives for its own tokens only (the rest are totals so far):
# a sample's meta_info joins them, as SGLang's last streamed meta_info holds the whole lists.
PER_RESPONSE_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs", "hidden_states")


@dataclass
class StreamPiece:
    """One response of the stream, as the caller sees it."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "" until the last response
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any]
    time_s: float  # seconds since the request was sent
    index: int = 0  # which of the request's n samples (the response's meta_info "index")


@dataclass
class GenerateResult:
    """One sample's aggregate. `generate_text` also lists the request's samples in `samples`."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta_info: dict[str, Any] = field(default_factory=dict)
    num_responses: int = 0
    ttft_s: Optional[float] = None
    total_s: float = 0.0
    index: int = 0  # which of the request's n samples
    # Mean inter-token latency after the first response that carried tokens: (time of the last
    # token response - ttft) / tokens after the first response. None with fewer than two.
    itl_s: Optional[float] = None
    samples: list["GenerateResult"] = field(default_factory=list)
    _first_tokens: int = field(default=0, repr=False, compare=False)

    def add(self, piece: StreamPiece) -> None:
        """Fold in the next response of this sample (its text is appended to `text`)."""
        self.num_responses += 1
        self.index = piece.index
        if piece.token_ids:
            if self.ttft_s is None:
                self.ttft_s = piece.time_s
                self._first_tokens = len(piece.token_ids)
            else:
                after_first = len(self.token_ids) + len(piece.token_ids) - self._first_tokens
                self.itl_s = (piece.time_s - self.ttft_s) / after_first
        self.text += piece.text
        self.token_ids.extend(piece.token_ids)
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.prompt_tokens = piece.prompt_tokens or self.prompt_tokens
        self.completion_tokens = piece.completion_tokens or self.completion_tokens
        if piece.meta_info:
            merged = {**self.meta_info, **piece.meta_info}
            for key in PER_RESPONSE_LISTS:  # each streamed response has only its own tokens' entries
                if isinstance(self.meta_info.get(key), list) and isinstance(piece.meta_info.get(key), list):
                    merged[key] = self.meta_info[key] + piece.meta_info[key]
            self.meta_info = merged
        self.total_s = piece.time_s


def build_sampling(
    *,
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Optional[Sequence[str]] = None,
    n: Optional[int] = None,
    prediction: Optional[str] = None,
    json_params: Optional[dict[str, Any] | str] = None,
) -> dict[str, Any]:
    """The SGLang sampling parameters of a request: `json_params`, then the named options on top."""
    if isinstance(json_params, str):
        try:
            json_params = json.loads(json_params)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-params is not valid JSON: {exc}") from None
    if json_params is not None and not isinstance(json_params, dict):
        raise ValueError("--json-params must be a JSON object")
    params: dict[str, Any] = dict(json_params or {})
    named = {
        "max_new_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "stop": list(stop) if stop else None,
        "n": n,
        "prediction": prediction,
    }
    params.update({k: v for k, v in named.items() if v is not None})
    return params


def build_inputs(
    model: str,
    prompt: Optional[str] = None,
    *,
    chat: bool = False,
    system: Optional[str] = None,
    input_ids: Optional[Sequence[int]] = None,
    sampling: Optional[dict[str, Any]] = None,
    stream: bool = True,
    tokenizer: Any = None,
    input_embeds: Optional[np.ndarray] = None,
) -> dict[str, Any]:
    """The input tensors (name -> Python value) for one request to `model`.

    All sampling parameters travel in the `sampling_parameters` JSON tensor, which both models
    accept and validate with the engine's own rules (unknown names are refused by the server).
    `input_embeds` ([num_tokens, hidden_size]) goes to either model as it is.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if sum(x is not None for x in (prompt, input_ids, input_embeds)) != 1:
        raise ValueError("give exactly one of a prompt, input_ids or input_embeds")
    if system is not None and not chat:
        raise ValueError("a system message needs chat (--system needs --chat)")
    if chat and prompt is None:
        # The chat template renders text; token ids or embeddings are already past it.
        raise ValueError("chat needs a text prompt, not input_ids or input_embeds")
    values: dict[str, Any] = {}
    messages = None
    if prompt is not None and chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if input_embeds is not None:
        values["input_embeds"] = np.asarray(input_embeds, dtype=np.float32)
    elif model == "ensemble":
        if input_ids is not None:
            values["input_ids"] = list(input_ids)
        elif messages is not None:
            values["messages"] = json.dumps(messages, ensure_ascii=False)
        else:
            values["text_input"] = prompt
    else:  # the engine takes token ids: tokenize here exactly as preprocessing would
        if input_ids is None:
            from backend.tokenizer import encode_prompt

            if tokenizer is None:
                raise ValueError("the llm model needs a tokenizer (tokenizer_path) for a text prompt")
            input_ids = encode_prompt(tokenizer, messages=messages) if messages is not None else encode_prompt(
                tokenizer, text=prompt
            )
        values["input_ids"] = list(input_ids)
    values["stream"] = bool(stream)
    if sampling:
        values["sampling_parameters"] = json.dumps(sampling)
    return values


def _scalar(value: Any, default: Any = None) -> Any:
    if value is None:
        return default
    arr = np.asarray(value).reshape(-1)
    if arr.size == 0:
        return default
    item = arr[0]
    return item.item() if isinstance(item, np.generic) else item


def _meta(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    raw = value if isinstance(value, str) else _scalar(value, "")
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    try:
        parsed = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"raw": raw}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


_tokenizers: dict[str, Any] = {}


def load_tokenizer_cached(path: str | Path) -> Any:
    from backend.tokenizer import load_tokenizer

    key = str(Path(path).resolve())
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(path)
    return _tokenizers[key]


def stream_pieces(
    prompt: Optional[str] = None,
    *,
    model: str = "ensemble",
    url: str = "localhost:8001",
    chat: bool = False,
    system: Optional[str] = None,
    input_ids: Optional[Sequence[int]] = None,
    input_embeds: Optional[np.ndarray] = None,
    stream: bool = True,
    detokenize: bool = True,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    timeout: float = 600.0,
    client: Optional[TritonStreamClient] = None,
    reorder: bool = True,
    abort_model: Optional[str] = "llm",
    request_id: Optional[str] = None,
    **sampling_options: Any,
) -> Iterator[StreamPiece]:
    """Stream one generation; yields a `StreamPiece` per server response, in generation order
    (`reorder`: responses the ensemble delivered out of order are held back until their turn).

    `sampling_options` are build_sampling's keywords (max_tokens, temperature, top_p, top_k,
    min_p, seed, stop, n, prediction, json_params). With n > 1 the samples' responses interleave; each
    piece's `index` says which sample it belongs to. Closing the iterator early (or an error, or
    no response within `timeout` seconds: TimeoutError) cancels the request and aborts it on
    `abort_model` (the engine model; None: cancel only), which an ensemble's cancellation alone
    does not reach. `request_id`: the Triton request id (default: a fresh one).
    """
    sampling = build_sampling(**sampling_options)
    tokenizer = None
    if model == "llm" and (detokenize or (input_ids is None and input_embeds is None)):
        tokenizer = load_tokenizer_cached(tokenizer_path)
    values = build_inputs(model, prompt, chat=chat, system=system, input_ids=input_ids, sampling=sampling,
                          stream=stream, tokenizer=tokenizer, input_embeds=input_embeds)
    client = client or TritonStreamClient(url, abort_model=abort_model)
    order = _InOrder() if reorder else None
    start = time.perf_counter()
    extra = {"request_id": request_id} if request_id else {}  # (a caller's own client may not take one)
    chunks = client.stream_generate(model, values, timeout=timeout, **extra)
    try:
        yield from _pieces(chunks, model, detokenize, tokenizer, order, start)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # now, not when collected: leaving early cancels and aborts the request


def _pieces(chunks: Iterator[dict[str, Any]], model: str, detokenize: bool, tokenizer: Any,
            order: Optional["_InOrder"], start: float) -> Iterator[StreamPiece]:
    for chunk in chunks:
        ids = chunk.get("output_ids")
        ids_list = [] if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]
        finish = _scalar(chunk.get("finish_reason"), "") or ""
        if isinstance(finish, bytes):
            finish = finish.decode("utf-8")
        if model == "ensemble":
            text = chunk.get("text_output") or ""
            if isinstance(text, list):
                text = "".join(text)
        elif detokenize:
            # The same function the postprocessing model runs on this response.
            from backend.triton_utils import postprocess_arrays

            arrays = {k: np.asarray(v) if not isinstance(v, str) else np.array([v.encode("utf-8")], dtype=np.object_)
                      for k, v in chunk.items() if v is not None}
            text = postprocess_arrays(tokenizer, arrays)["text_output"][0].decode("utf-8")
        else:
            text = ""
        meta = _meta(chunk.get("meta_info"))
        index = meta.get("index", 0)
        piece = StreamPiece(
            text=text,
            token_ids=ids_list,
            finish_reason=finish,
            prompt_tokens=int(_scalar(chunk.get("prompt_tokens"), 0)),
            completion_tokens=int(_scalar(chunk.get("completion_tokens"), 0)),
            meta_info=meta,
            time_s=time.perf_counter() - start,
            index=index if isinstance(index, int) else 0,
        )
        yield from (order.push(piece) if order is not None else [piece])
    if order is not None:
        yield from order.flush()


class _InOrder:
    """Puts a stream's responses back in generation order.

    The ensemble runs postprocessing as a separate request per llm response, on any of its
    instances, and forwards whichever finishes first: two responses close together can reach
    the client swapped (seen here with postprocessing `count: 2`). Each response carries the
    cumulative `completion_tokens`, so the tokens it holds start at completion_tokens - len(ids);
    pieces are released once everything before them has been.
    """

    def __init__(self) -> None:
        self.done: dict[Any, int] = {}
        self.pending: dict[Any, list[StreamPiece]] = {}
        self.reordered = 0  # responses that arrived before an earlier one

    def push(self, piece: StreamPiece) -> list[StreamPiece]:
        key = piece.index
        begin = piece.completion_tokens - len(piece.token_ids)
        done = self.done.get(key, 0)
        if begin > done:
            self.reordered += 1
            self.pending.setdefault(key, []).append(piece)
            return []
        out = [piece]
        done = max(done, piece.completion_tokens)
        waiting = self.pending.get(key, [])
        while waiting:
            nxt = next((p for p in waiting if p.completion_tokens - len(p.token_ids) <= done), None)
            if nxt is None:
                break
            waiting.remove(nxt)
            out.append(nxt)
            done = max(done, nxt.completion_tokens)
        self.done[key] = done
        return out

    def flush(self) -> list[StreamPiece]:
        rest = [p for waiting in self.pending.values() for p in waiting]
        self.pending.clear()
        return sorted(rest, key=lambda p: (p.index, p.completion_tokens - len(p.token_ids), p.completion_tokens))


def stream_text(prompt: Optional[str] = None, **kwargs: Any) -> Iterator[str]:
    """Stream one generation's text as it arrives (see `stream_pieces` for the keywords).

    With n > 1 the samples' text would interleave: use `stream_pieces` (each piece's `index`).
    """
    for piece in stream_pieces(prompt, **kwargs):
        if piece.text:
            yield piece.text


def generate_text(prompt: Optional[str] = None, **kwargs: Any) -> GenerateResult:
    """Run one generation to the end and aggregate it (see `stream_pieces` for the keywords).

    Responses are grouped by their sample index (meta_info "index"), never by arrival order:
    `samples` holds one GenerateResult per sample, in index order. The top-level fields are
    sample 0's (with n == 1, the whole generation), except `num_responses` and `total_s`,
    which count the whole request.
    """
    by_index: dict[int, GenerateResult] = {}
    num_responses = 0
    total_s = 0.0
    for piece in stream_pieces(prompt, **kwargs):
        num_responses += 1
        total_s = piece.time_s
        by_index.setdefault(piece.index, GenerateResult(index=piece.index)).add(piece)
    samples = [by_index[i] for i in sorted(by_index)]
    first = samples[0] if samples else GenerateResult()
    result = replace(first, samples=samples, num_responses=num_responses, total_s=total_s,
                     token_ids=list(first.token_ids), meta_info=dict(first.meta_info))
    return result


class SampleWriter:
    """Prints a request's pieces to `out`, each sample apart from the others.

    n == 1: the text (or, with `ids`, the space-separated token ids) as it arrives, then a
    newline at the end: plain token-by-token streaming.

    n > 1: one block per sample, in index order, each a `[sample i]` line, the sample's text and
    a newline. Pieces are grouped by their sample index, never by arrival order. The lowest
    unfinished sample streams live under its header; the others are held until it finishes,
    then the next one's held text is printed and it goes on live, so the output reads as
    --no-stream's while it arrives. A sample index at or above `n` (a server answering with more
    samples than asked) gets a block of its own in the same way.
    """

    def __init__(self, out: Any, n: int = 1, ids: bool = False) -> None:
        self.out = out
        self.n = max(1, n)
        self.multi = self.n > 1
        self.ids = ids
        self.live = 0  # the sample printed as it arrives
        self.held: dict[int, list[str]] = {}  # sample index -> text not printed yet
        self.finished: set[int] = set()
        self.has_ids: set[int] = set()  # samples whose ids have started (for the separator)
        self.headed = False  # the live sample's header is out

    def _chunk(self, piece: StreamPiece) -> str:
        if not self.ids:
            return piece.text
        if not piece.token_ids:
            return ""
        sep = " " if piece.index in self.has_ids else ""
        self.has_ids.add(piece.index)
        return sep + " ".join(map(str, piece.token_ids))

    def _header(self) -> None:
        if self.multi and not self.headed:
            self.out.write(f"[sample {self.live}]\n")
        self.headed = True

    def _end_live(self) -> None:
        """The live sample is done: close its block, then print held samples until one is unfinished."""
        while True:
            self._header()
            self.out.write("".join(self.held.pop(self.live, [])) + "\n")
            self.live += 1
            self.headed = False
            if self.live not in self.held and self.live >= self.n:
                return
            self._header()
            self.out.write("".join(self.held.pop(self.live, [])))
            if self.live not in self.finished:
                return

    def feed(self, piece: StreamPiece) -> None:
        chunk = self._chunk(piece)
        if not self.multi and piece.index == 0:
            self.out.write(chunk)
        elif piece.index == self.live:
            self._header()
            self.out.write(chunk)
            if piece.finish_reason:
                self.finished.add(piece.index)
                self._end_live()
        else:
            # Another sample (or, with n == 1, an unexpected one: printed as its own block at the end).
            self.held.setdefault(piece.index, []).append(chunk)
            if piece.finish_reason:
                self.finished.add(piece.index)
        self.out.flush()

    def close(self) -> None:
        """The stream ended: print what is still held (unfinished samples included), in index order."""
        if not self.multi:
            self.out.write("\n")
            for index in sorted(self.held):
                self.out.write(f"[sample {index}]\n" + "".join(self.held.pop(index)) + "\n")
        else:
            if self.headed or self.live in self.held:
                self._header()
                self.out.write("".join(self.held.pop(self.live, [])) + "\n")
            for index in sorted(self.held):
                self.out.write(f"[sample {index}]\n" + "".join(self.held.pop(index)) + "\n")
        self.out.flush()


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}s"


def _rate(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f} tok/s"


def stats_line(sample: GenerateResult, label: str = "") -> str:
    """One sample's --stats line: finish reason, counts, TTFT, ITL, total and decode rate."""
    decode_s = sample.total_s - (sample.ttft_s or 0.0)
    after_first = sample.completion_tokens - sample._first_tokens if sample.ttft_s is not None else 0
    # One response with every token (--no-stream) leaves no decode time to measure: n/a.
    rate = _rate(after_first / decode_s if after_first > 0 and decode_s > 0 else None)
    itl = "n/a" if sample.itl_s is None else f"{sample.itl_s * 1000:.2f}ms"
    return (
        f"[{label}finish_reason={sample.finish_reason} prompt_tokens={sample.prompt_tokens} "
        f"completion_tokens={sample.completion_tokens} ttft={_seconds(sample.ttft_s)} itl={itl} "
        f"total={sample.total_s:.3f}s decode={rate} meta={json.dumps(sample.meta_info)}]"
    )


def stats_lines(samples: Sequence[GenerateResult], n: int = 1) -> list[str]:
    """--stats: n == 1, one line as ever; n > 1, a line per sample then a total line."""
    samples = sorted(samples, key=lambda r: r.index)
    if n <= 1 and len(samples) == 1:
        return [stats_line(samples[0])]
    lines = [stats_line(s, f"sample {s.index}: ") for s in samples]
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    total_s = max((s.total_s for s in samples), default=0.0)
    tokens = sum(s.completion_tokens for s in samples)
    reasons: dict[str, int] = {}
    for s in samples:
        reasons[s.finish_reason or "unfinished"] = reasons.get(s.finish_reason or "unfinished", 0) + 1
    rate = _rate(tokens / total_s if total_s > 0 else None)
    lines.append(
        f"[total: samples={len(samples)}/{n} prompt_tokens={max((s.prompt_tokens for s in samples), default=0)} "
        f"completion_tokens={tokens} finish_reasons={','.join(f'{k}:{v}' for k, v in reasons.items())} "
        f"ttft={_seconds(min(ttfts) if ttfts else None)} total={total_s:.3f}s throughput={rate}]"
    )
    return lines


N_HELP = """\
n > 1 (--n 2, or "n" in --json-params): the samples' responses arrive interleaved; the client
groups them by each response's sample index (meta_info "index"), never by arrival order, and
prints one block per sample, in index order:

  [sample 0]
  <sample 0's text>
  [sample 1]
  <sample 1's text>

Streaming, the lowest unfinished sample is printed live under its header while the others are
held; when it finishes, the next sample's held text is printed and it goes on live. So the
output is the same as --no-stream's, shown as it arrives. --ids prints each sample's ids the
same way. --stats prints one line per sample ("[sample i: finish_reason=... completion_tokens=...
ttft=... itl=... ...]") and a "[total: ...]" line. With n == 1 the text streams as it arrives,
with no header, as always.
"""


def grpc_url(value: str) -> str:
    """--url: host:port of Triton's gRPC endpoint; an HTTP URL failed with gRPC's "Misformatted
    domain name" (QA)."""
    if value.startswith(("http://", "https://", "grpc://")):
        raise argparse.ArgumentTypeError(f"Triton's gRPC endpoint as host:port (8001 by default), not a URL: {value!r}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m client",
        description="Stream a generation from tritonserver (ensemble or llm model) over gRPC.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=N_HELP,
    )
    p.add_argument("prompt", nargs="?", help="prompt text (read from stdin when omitted or '-')")
    p.add_argument("--model", choices=MODELS, default="ensemble",
                   help="ensemble: text in, text out; llm: the engine alone (tokenized/detokenized here)")
    p.add_argument("--url", type=grpc_url, default=os.environ.get("TRITON_GRPC_URL", "localhost:8001"),
                   help="Triton gRPC host:port")
    p.add_argument("--max-tokens", type=int, default=None, help="max_new_tokens")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    # One string per --stop: nargs="+" would take a prompt given after it as a stop string.
    p.add_argument("--stop", action="append", default=None, metavar="STR", help="a stop string (repeatable)")
    p.add_argument("-n", "--n", type=int, default=None, metavar="N",
                   help="samples of the prompt (SGLang's n; also accepted in --json-params); see below for the output")
    p.add_argument("--prediction", default=None, metavar="TEXT|@FILE",
                   help="Predicted Outputs: text the output is expected to largely repeat (a file to be returned "
                        "with edits: @path reads it); drafted and verified, so the output is the same, sooner. "
                        "--stats shows accepted_prediction_tokens / rejected_prediction_tokens in meta")
    p.add_argument("--json-params", default=None, metavar="JSON",
                   help='any SGLang sampling parameters as a JSON object, e.g. \'{"ignore_eos": true}\'; '
                        "the named options above override it")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (needs --chat)")
    p.add_argument("--input-ids", default=None, metavar="IDS",
                   help="comma-separated prompt token ids instead of text")
    p.add_argument("--input-embeds", default=None, metavar="FILE.npy",
                   help="the prompt as embeddings instead of text: a numpy file of shape [num_tokens, hidden_size]")
    p.add_argument("--no-stream", action="store_true",
                   help="ask for one response with the whole result (one per sample with n > 1)")
    p.add_argument("--ids", action="store_true", help="print token ids as they arrive instead of text")
    p.add_argument("--stats", action="store_true",
                   help="print finish reason, token counts, TTFT, ITL and tokens/s to stderr "
                        "(with n > 1: a line per sample, then a total line)")
    p.add_argument("--tokenizer-path", default=DEFAULT_TOKENIZER,
                   help="HF model directory for local (de)tokenization with --model llm (default: models/demo)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for each response; past it the request is cancelled (exit 1)")
    p.add_argument("--abort-model", default="llm", metavar="MODEL",
                   help="the engine model that a request left early (Ctrl-C, error, timeout) is also aborted on, "
                        "since an ensemble's cancellation does not reach it (default: llm; '' for none)")
    args = p.parse_args(argv)
    if args.system is not None and not args.chat:
        p.error("--system needs --chat (the system message goes through the chat template)")
    if not args.timeout > 0:  # NaN too; before anything is sent (QA: -1 and 0 failed after sending)
        p.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if args.chat and (args.input_ids is not None or args.input_embeds is not None):
        p.error("--chat needs a text prompt: --input-ids and --input-embeds are already past the chat template")
    return args


class _StderrHandler(logging.Handler):
    """Log records as "warning: ..." lines on whatever sys.stderr is at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"warning: {record.getMessage()}", file=sys.stderr)


def _log_warnings_to_stderr() -> None:
    """The library's warnings (a failed abort) as one line each on stderr."""
    logger = logging.getLogger("client")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler(logging.WARNING))
        logger.setLevel(logging.WARNING)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a supervisor): ended as Ctrl-C ends the CLI, the request
    cancelled and aborted, or the engine would generate on to its limit."""


class _Interrupts:
    """The CLI's SIGINT and SIGTERM handler: the first one ends the stream (KeyboardInterrupt, or
    _Terminated for SIGTERM), and any later one is only counted. The library holds signals while
    it cancels and aborts a request left early, but only from its cleanup's start: a second
    Ctrl-C 1 ms after the first could land before that, on a loaded host, and skip the abort (CI:
    the request ran on to its length)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    _log_warnings_to_stderr()
    input_ids = input_embeds = None
    prompt = args.prompt
    given = [name for name, v in (("a prompt", prompt), ("--input-ids", args.input_ids),
                                  ("--input-embeds", args.input_embeds)) if v is not None]
    if len(given) > 1:
        print(f"error: give one of a prompt, --input-ids and --input-embeds (got {' and '.join(given)})", file=sys.stderr)
        return 2
    if args.input_embeds is not None:
        try:
            input_embeds = np.load(args.input_embeds, allow_pickle=False)
        except (OSError, ValueError) as exc:
            print(f"error: --input-embeds: {exc}", file=sys.stderr)
            return 2
        prompt = None
    elif args.input_ids is not None:
        try:
            input_ids = [int(t) for t in args.input_ids.replace(" ", "").split(",") if t]
        except ValueError:
            print("error: --input-ids must be comma-separated integers", file=sys.stderr)
            return 2
        prompt = None
    elif prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if prompt == "" and not args.chat:  # the server would say a prompt is missing
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    from tritonclient.utils import InferenceServerException

    prediction = args.prediction
    if prediction is not None and prediction.startswith("@"):
        try:
            prediction = Path(prediction[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"error: --prediction: {exc}", file=sys.stderr)
            return 2
    sampling_options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop, n=args.n,
                            prediction=prediction, json_params=args.json_params)
    try:
        n = build_sampling(**sampling_options).get("n", 1)
    except ValueError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    n = n if isinstance(n, int) and not isinstance(n, bool) else 1  # the server refuses a bad one
    writer = SampleWriter(sys.stdout, n=n, ids=args.ids)
    samples: dict[int, GenerateResult] = {}

    def report() -> None:
        if args.stats and samples:
            for line in stats_lines(list(samples.values()), n):
                print(line, file=sys.stderr)

    pieces = stream_pieces(
        prompt,
        model=args.model,
        url=args.url,
        chat=args.chat,
        system=args.system,
        input_ids=input_ids,
        input_embeds=input_embeds,
        stream=not args.no_stream,
        detokenize=not args.ids,
        tokenizer_path=args.tokenizer_path,
        timeout=args.timeout,
        abort_model=args.abort_model or None,
        **sampling_options,
    )
    previous: dict[int, Any] = {}
    interrupts = _Interrupts()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Not SIGINT where it is ignored (started in the background, `cmd &`): as before.
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        try:
            previous[sig] = signal.signal(sig, interrupts)
        except ValueError:  # not the main thread (a caller's own): its signals are its own
            break
    try:
        try:
            for piece in pieces:
                samples.setdefault(piece.index, GenerateResult(index=piece.index)).add(piece)
                writer.feed(piece)
        finally:
            pieces.close()  # a Ctrl-C here, not in the stream, cancels and aborts the request too
    except KeyboardInterrupt as exc:
        if writer.multi:
            writer.close()  # what the samples generated so far, each in its block
        terminated = isinstance(exc, _Terminated)
        print(f"\n[{'terminated' if terminated else 'interrupted'}: request cancelled]", file=sys.stderr)
        return 143 if terminated else 130
    except (InferenceServerException, ValueError, RuntimeError, OSError) as exc:
        if writer.multi:
            writer.close()
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    writer.close()
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
