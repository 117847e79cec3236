"""The JSON-array tool-call format's streaming reader against the whole-text scanner.

The reference streams by rescanning everything received with `scan_json_array_calls` at each
chunk (what the parser did before it became incremental): the incremental reader must give the
same items for every chunking, on valid arrays, arrays cut anywhere, and malformed ones.
"""

from __future__ import annotations

import json
import random
import time

from openai_frontend.json_array_calls import JsonArrayToolParser, scan_json_array_calls
from openai_frontend.tools import parse_as_streamed


def rescan_stream(chunks: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    buf, normal, sent_names, sent_args, passthrough = "", "", 0, [], False
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        if passthrough:
            normal += chunk
            continue
        buf += chunk
        found = scan_json_array_calls(buf)
        if found is None:
            passthrough, normal = True, normal + buf
            continue
        for k, (name, params, _) in enumerate(found):
            if name is None:
                break
            if k >= sent_names:
                calls[k] = [name, ""]
                sent_names += 1
                sent_args.append(0)
            if params is not None:
                args = buf[params[0]:params[1]]
                calls[k][1] += args[sent_args[k]:]
                sent_args[k] = max(sent_args[k], len(args))
    if not passthrough and not buf.strip():
        normal += buf  # only whitespace came: it is text
    return normal, [(k, n, a) for k, (n, a) in sorted(calls.items())]


def incremental_stream(chunks: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    p = JsonArrayToolParser()
    normal = ""
    calls: dict[int, list[str]] = {}
    results = [p.parse_streaming_increment(c, None) for c in chunks] + [p.flush()]
    for r in results:
        normal += r.normal_text
        for item in r.calls:
            if item.name is not None:
                assert item.tool_index not in calls and item.parameters == ""
                calls[item.tool_index] = [item.name, ""]
            else:
                calls[item.tool_index][1] += item.parameters
    return normal, [(k, n, a) for k, (n, a) in sorted(calls.items())]


def rand_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.25:
        return {f"k{i}\"\\{rng.choice('{}[]')}": rand_value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.4:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice(["a}b", 'q"uo\\te', "北京 😀", "[{", "", 0, -1.5e3, True, False, None, 12345])


def dump(rng: random.Random, value) -> str:
    sep = rng.choice([(", ", ": "), (",", ":"), (" ,\n ", " : ")])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=sep)


def rand_text(rng: random.Random) -> str:
    objs = []
    for _ in range(rng.randint(0, 3)):
        members = [f'"name": {json.dumps(rng.choice(["search", "get_time", "f"]))}',
                   f'"{rng.choice(["parameters", "arguments"])}": {dump(rng, {"q": rand_value(rng), "n": rand_value(rng)})}']
        if rng.random() < 0.3:
            members.reverse()  # arguments before the name
        if rng.random() < 0.2:
            members.insert(1, f'"extra": {dump(rng, rand_value(rng))}')
        if rng.random() < 0.2:  # keys are read whole: spaces and escapes included
            members.insert(rng.randint(0, len(members)), '" name ": "decoy"')
        if rng.random() < 0.2:
            members = [m.replace('"name"', '"na\\u006de"', 1) for m in members]
        if rng.random() < 0.05:
            members = members[1:]  # no name
        objs.append("{" + rng.choice([", ", ","]).join(members) + "}")
    text = rng.choice(["", " ", "\n "]) + "[" + rng.choice([", ", ",\n"]).join(objs) + "]"
    r = rng.random()
    if r < 0.4:
        text = text[: rng.randint(0, len(text))]  # cut anywhere
    elif r < 0.5:
        i = rng.randint(0, len(text))
        text = text[:i] + rng.choice(["x", "}", "]", ":", '"', "\\"]) + text[i:]  # broken
    elif r < 0.55:
        text = rng.choice(["Sure: ", "  plain", "{"]) + text  # not the format
    return text


def chunkings(rng: random.Random, text: str):
    yield [text]
    yield list(text)
    for _ in range(4):
        chunks, i = [], 0
        while i < len(text):
            k = rng.choice([1, 2, 3, 5, 8, 13, 40])
            chunks.append(text[i:i + k])
            i += k
        yield chunks


def test_incremental_stream_equals_rescanning_on_every_chunking():
    rng = random.Random(7)
    named = 0
    for _ in range(600):
        text = rand_text(rng)
        expected = rescan_stream([text])
        named += len(expected[1])
        for chunks in chunkings(rng, text):
            assert rescan_stream(chunks) == expected, chunks  # the reference itself is chunk-free
            assert incremental_stream(chunks) == expected, chunks
    assert named > 300


def test_whole_valid_array_parses_the_same_both_ways():
    text = '[{"name": "f", "parameters": {"a": "}]\\"", "b": [1, {"c": null}]}}, {"parameters": {}, "name": "g"}]'
    whole = JsonArrayToolParser().detect_and_parse(text, None)
    normal, calls = parse_as_streamed(JsonArrayToolParser(), text, [])
    assert normal == whole.normal_text == ""
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.parameters) for c in whole.calls]


def test_long_arguments_stream_in_linear_time():
    # Rescanning per chunk made this quadratic: ~1 s of event loop at a tenth of this length.
    args = json.dumps({"text": "word " * 20000, "n": list(range(2000))})
    text = '[{"name": "f", "parameters": ' + args + "}]"
    p = JsonArrayToolParser()
    start = time.process_time()
    got = "".join(item.parameters for i in range(0, len(text), 4)
                  for item in p.parse_streaming_increment(text[i:i + 4], None).calls)
    elapsed = time.process_time() - start
    assert got == args
    assert elapsed < 1.0, elapsed  # CPU time; about 0.05 s here, where rescanning needs minutes
