"""The redactor by itself: checksums, masks, JSON safety, and that any split of a
stream gives the same bytes as the whole while holding back only what could still
become a match."""

from __future__ import annotations

import json
import random
import re

import pytest

from aiproxy.governance.redact import (
    ORDER,
    Redactor,
    compile_detector,
    iban_ok,
    luhn,
    prc_id_ok,
    redact_text,
)

DETECTOR = compile_detector(ORDER)


def test_checksums():
    assert luhn(b"4111111111111111") and not luhn(b"4111111111111112")
    assert luhn(b"378282246310005")  # Amex, 15 digits
    assert iban_ok(b"GB82 WEST 1234 5698 7654 32") and iban_ok(b"DE89370400440532013000")
    assert not iban_ok(b"GB82 WEST 1234 5698 7654 33")
    assert prc_id_ok(b"11010519491231002X") and prc_id_ok(b"110105194912310029") is False


@pytest.mark.parametrize("text, masked, kind", [
    (b"pay with 4111-1111-1111-1111 today", b"pay with ****-****-****-1111 today", "card"),
    (b"amex 378282246310005.", b"amex ***********0005.", "card"),
    (b"ssn 078-05-1120 ok", b"ssn ***-**-1120 ok", "us_ssn"),
    (b"IBAN DE89370400440532013000", b"IBAN ******************3000", "iban"),
    (b"ID 11010519491231002x", b"ID **************002x", "prc_id"),
    (b"mail jane_doe+x@mail.example.co.uk", b"mail ****_***+*@****.*******.co.uk", "email"),
    (b"tel (415) 555-0100", b"tel (***) ***-0100", "phone"),
])
def test_masks_keep_last_four(text, masked, kind):
    out, counts = redact_text(text)
    assert out == masked and counts == {kind: 1}
    assert len(out) == len(text)


@pytest.mark.parametrize("text", [
    b"order 4111 1111 1111 1112", b"ssn 666-12-3456", b"ssn 123-00-4567",
    b"id 110105194912310029", b"year 2026", b"version 1.2.3", b"IBAN GB82 WEST 1234 5698 7654 33",
])
def test_left_alone(text):
    assert redact_text(text) == (text, {})


def _sse(parts: list[str]) -> bytes:
    out = b""
    for i, p in enumerate(parts):
        out += b"event: delta\nid: %d\n" % i
        out += b"data: " + json.dumps({"id": "chatcmpl-9", "created": 4111111111111111,
                                       "choices": [{"delta": {"content": p}}]}).encode()
        out += b"\n\n"
    return out + b"data: [DONE]\n\n"


def _run(data: bytes, mode: str, cuts: list[int]) -> tuple[bytes, Redactor, list[bytes]]:
    r = Redactor(DETECTOR, mode)
    pieces, last = [], 0
    for c in [*cuts, len(data)]:
        pieces.append(r.feed(data[last:c]))
        last = c
    pieces.append(r.end())
    return b"".join(pieces), r, pieces


def test_any_split_gives_the_same_result_and_valid_json():
    parts = ["Card: 4111", " 1111 ", "1111 1111\n and \"mail\" x.y@", "corp.example.com, tel +44",
             " 20 7946 0958. \u00e9t\u00e9 ssn 078-05-", "1120 end"]
    data = _sse(parts)
    whole, r, _ = _run(data, "sse", [])
    assert r.counts == {"card": 1, "email": 1, "phone": 1, "us_ssn": 1}
    text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"]
                   for line in whole.decode().split("\n")
                   if line.startswith("data: {"))
    assert "Card: **** **** **** 1111\n" in text
    assert "*.*@****.******e.com" in text and "+** ** **** 0958" in text
    assert "***-**-1120" in text
    assert b'"created": 4111111111111111' in whole  # a JSON number is never touched
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        out, _, _ = _run(data, "sse", cuts)
        assert out == whole, cuts


def test_holds_only_what_could_still_match():
    r = Redactor(DETECTOR, "text")
    assert r.feed(b"hello world, my card is 4111 11") == b"hello world, my card is "
    # "thanks" could still be the start of an e-mail address: held until it cannot.
    assert r.feed(b"11 1111 1111 thanks") == b"**** **** **** 1111 "
    assert r.feed(b"! bye") == b"thanks! "
    assert r.end() == b"bye"
    # JSON: outside strings nothing is held; inside, from the candidate's first byte.
    r = Redactor(DETECTOR, "json")
    assert r.feed(b'{"n": 12345, "t": "ok then 078-') == b'{"n": 12345, "t": "ok then '
    assert r.feed(b'05-1120"}') == b'***-**-1120"}'
    # An escape cut in half is held whole.
    r = Redactor(DETECTOR, "json")
    assert r.feed(b'{"t": "a \\u00') == b'{"t": "a '
    assert r.feed(b'e9"}') == b'\\u00e9"}'


def test_escaped_characters_are_read_as_what_they_stand_for():
    """A serializer that escapes (json.dumps's default for non-ASCII, or one that
    escapes "@") must not hide a secret: escapes are read as their characters, and one
    standing for a masked character is masked whole, so the JSON stays valid."""
    for text, masked in (
            (b"mail alice.secret\\u0040example.com now",
             "mail *****.******@******e.com now"),
            (b"card 4111\\u00a01111\\u00a01111\\u00a01111 ok",
             "card ****\u00a0****\u00a0****\u00a01111 ok"),
            (b"ssn 123\\u002d45-6789", "ssn ***-**-6789"),
            # the escaped "1" is one of the masked digits: its 6 bytes become 6 "*"
            (b"card 4111\\u003111111111111", "card " + "*" * 17 + "1111")):
        body = b'{"t": "' + text + b'"}'
        out, counts = redact_text(body, mode="json")
        assert len(out) == len(body) and counts, (body, out)
        assert json.loads(out)["t"] == masked, out


def test_escapes_are_never_masked():
    body = json.dumps({"t": "x\n4111111111111111\tand\\u0041 a@b.cd"}).encode()
    out, counts = redact_text(body, mode="json")
    doc = json.loads(out)
    assert doc["t"] == "x\n************1111\tand\\u0041 a@b.cd" and counts["card"] == 1


def test_decoder_codings_truncation_and_bombs():
    import gzip
    import zlib

    from aiproxy.governance.decoding import MAX_EXPANSION, DecodeError, decoder_for

    data = b"x" * 100_000 + b"end"
    for coding, blob in ((b"gzip", gzip.compress(data)), (b"x-gzip, identity", gzip.compress(data)),
                         (b"deflate", zlib.compress(data))):
        d = decoder_for(coding)
        out = b"".join(d.feed(blob[i:i + 7]) for i in range(0, len(blob), 7)) + d.end()
        assert out == data, coding
    for coding in (b"br", b"zstd", b"gzip, gzip", b"compress"):
        assert decoder_for(coding) is None, coding
    d = decoder_for(b"gzip")
    d.feed(gzip.compress(data)[:-9])
    with pytest.raises(DecodeError):
        d.end()
    assert decoder_for(b"gzip").end() == b""  # no body at all
    d = decoder_for(b"gzip")
    with pytest.raises(DecodeError):
        d.feed(gzip.compress(b"\0" * (MAX_EXPANSION + 1)))


def _choice_chunk(index: int, text: str) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-2", "created": 1764460800, "choices": [
        {"index": index, "delta": {"content": text}, "finish_reason": None}]}).encode() + b"\n\n"


def test_interleaved_choices_are_each_their_own_text():
    """n=2: the events alternate between choices, so a card split over choice 0's events
    is never contiguous in the stream; each choice's text is read by itself."""
    first = ["Card A is 4111 11", "11 1111 1", "111, done"]
    second = ["Card B is 5555 5555", " 5555 4444 and mail", " ann@example.org"]
    data = b"".join(_choice_chunk(0, a) + _choice_chunk(1, b)
                    for a, b in zip(first, second, strict=True))
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 1, "function": {"arguments": '{"ssn": "078-05-'}}]}}]}
    data += b"data: " + json.dumps(tool).encode() + b"\n\n" + _choice_chunk(1, " bye")
    tool["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] = '1120"}'
    data += b"data: " + json.dumps(tool).encode() + b"\n\ndata: [DONE]\n\n"
    whole, r, _ = _run(data, "sse", [])
    assert r.counts == {"card": 2, "email": 1, "us_ssn": 1}
    texts: dict[int, str] = {0: "", 1: ""}
    args = ""
    for line in whole.decode().split("\n"):
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            if "tool_calls" in choice["delta"]:
                args += choice["delta"]["tool_calls"][0]["function"]["arguments"]
            else:
                texts[choice["index"]] += choice["delta"]["content"]
    assert texts == {0: "Card A is **** **** **** 1111, done",
                     1: "Card B is **** **** **** 4444 and mail ***@******e.org bye"}
    assert args == '{"ssn": "***-**-1120"}'
    rng = random.Random(11)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        assert _run(data, "sse", cuts)[0] == whole, cuts


def test_plain_text_data_lines_are_text():
    """data: values that are not JSON are text: one running text across events (so a
    card split over two of them is masked), the lines of one event joined with "\n";
    a stray quote in one never turns the JSON events after it inside out."""
    data = (b"data: my card is 4111 11\n\n"
            b"data:  11 1111 1111, thanks\r\n\r\n"
            b": a comment 4111 1111 1111 1111\n"
            b"event: note\nid: 7\ndata: he said \"hi, call +44 20\ndata: 7946 0958\n\n"
            + _choice_chunk(0, "and 078-05-") + _choice_chunk(0, "1120 ok")
            + b"data: [DONE]\n\n")
    whole, r, _ = _run(data, "sse", [])
    assert r.counts == {"card": 1, "us_ssn": 1}
    assert b"data: my card is **** **\n\ndata:  ** **** 1111, thanks\r\n\r\n" in whole
    assert b": a comment 4111 1111 1111 1111\n" in whole  # comments are no data
    # "+44 20" and "7946 0958" are on two lines of one event: not one number
    assert b'data: he said "hi, call +44 20\ndata: 7946 0958\n' in whole
    deltas = [json.loads(line[6:])["choices"][0]["delta"]["content"]
              for line in whole.decode().split("\n") if line.startswith("data: {")]
    assert deltas == ["and ***-**-", "1120 ok"]
    rng = random.Random(5)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        assert _run(data, "sse", cuts)[0] == whole, cuts


def _anthropic_delta(index: int, delta: dict) -> bytes:
    event = {"type": "content_block_delta", "index": index, "delta": delta}
    return b"event: content_block_delta\ndata: " + json.dumps(event).encode() + b"\n\n"


def test_anthropic_thinking_and_tool_input_are_running_texts():
    """Anthropic streams a thinking block in thinking_delta events and a tool call's input
    in input_json_delta events (`partial_json`: pieces of a JSON text, as OpenAI's
    `arguments`): each block is one running text, so a value split over its events is
    masked whole, and the tool input stays JSON."""
    thinking = ["the card is 4111 11", "11 1111 1111 ok"]
    tool = ['{"to": "bob@exa', 'mple.com", "card": "4111 1111 ', '1111 1111"}']
    data = b"".join(_anthropic_delta(0, {"type": "thinking_delta", "thinking": t})
                    for t in thinking)
    data += b"".join(_anthropic_delta(1, {"type": "input_json_delta", "partial_json": p})
                     for p in tool)
    whole, r, _ = _run(data, "sse", [])
    assert r.counts == {"card": 2, "email": 1}
    texts = {0: "", 1: ""}
    for line in whole.decode().split("\n"):
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            delta = event["delta"]
            texts[event["index"]] += delta.get("thinking", delta.get("partial_json", ""))
    assert texts[0] == "the card is **** **** **** 1111 ok"
    assert json.loads(texts[1]) == {"to": "***@******e.com", "card": "**** **** **** 1111"}
    rng = random.Random(5)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        assert _run(data, "sse", cuts)[0] == whole, cuts


@pytest.mark.parametrize("text, masked, kind", [
    # fullwidth forms (NFKC): each masked character's 3 bytes become "***"
    ("mail ｊａｎｅ＠ｅｘａｍｐｌｅ．ｃｏｍ ok", "mail " + "*" * 12 + "＠" + "*" * 18 + "ｅ．ｃｏｍ ok",
     "email"),
    ("card ４１１１ １１１１ １１１１ １１１１ ok", "card " + " ".join(["*" * 12] * 3) + " １１１１ ok",
     "card"),
    # zero-width characters, soft hyphen, word joiner and BOM are read past and kept
    ("card 4111\u200b1111\u200c1111\u200d1111 ok", "card ****\u200b****\u200c****\u200d1111 ok",
     "card"),
    ("mail jane\u00ad.doe@exa\u2060mple.com x", "mail ****\u00ad.***@***\u2060***e.com x", "email"),
    ("\ufeff4111111111111111 \u00e9t\u00e9", "\ufeff************1111 \u00e9t\u00e9", "card"),
    ("ssn 078\u200b-05-1120", "ssn ***\u200b-**-1120", "us_ssn"),
])
def test_text_is_read_normalized_and_kept(text, masked, kind):
    """Fullwidth characters (NFKC) and invisible ones must not hide a value; what is
    not masked (the invisible characters, the other text) is left as it was."""
    body = text.encode()
    out, counts = redact_text(body)
    assert out.decode() == masked and counts == {kind: 1}
    assert len(out) == len(body)
    # The same escaped (json.dumps's default): an escape of a masked character is masked whole.
    doc = json.dumps({"t": text}).encode()
    out, counts = redact_text(doc, mode="json")
    assert counts == {kind: 1} and len(out) == len(doc)
    stars = re.compile(r"\*+")  # an escape's 6 bytes are masked, a character's 3
    assert stars.sub("*", json.loads(out)["t"]) == stars.sub("*", masked)


def test_non_ascii_stream_any_split_gives_the_same_result():
    """A character cut by a read (a fullwidth digit's 3 bytes over two events of the
    transport) is held until whole: any split reads the same text."""
    parts = ["Card: ４１１１ １１", "１１ 1111\u200b1111 and été ", "ｂｏｂ＠ｅｘａｍｐｌｅ.org"]
    data = b"".join(p.encode() for p in parts)
    whole, r, _ = _run(data, "text", [])
    assert r.counts == {"card": 1, "email": 1}
    assert whole.decode() == ("Card: " + "*" * 12 + " " + "*" * 12 + " ****\u200b1111 and été "
                              + "*" * 9 + "＠" + "*" * 18 + "ｅ.org")
    rng = random.Random(11)
    for cuts in [list(range(1, len(data)))] + [
            sorted(rng.sample(range(1, len(data)), rng.randint(1, 30))) for _ in range(100)]:
        out, _, _ = _run(data, "text", cuts)
        assert out == whole, cuts
    body = json.dumps({"t": "".join(parts)}, ensure_ascii=False).encode()
    whole, _, _ = _run(body, "json", [])
    for i in range(1, len(body)):
        assert _run(body, "json", [i])[0] == whole, i


@pytest.mark.parametrize("data, mode", [
    (b' \n{"created": 1764460800123, "t": "call +1 415 555 0100"}', "json"),
    (_sse(["card 4111 1111 ", "1111 1111 ok"]), "sse"),
    (b": comment\ndata: plain 4111 1111 1111 1111\n\n", "sse"),
    (b"dat 4111 1111 1111 1111", "text"),
])
def test_auto_mode_reads_as_the_first_bytes_tell(data, mode):
    """A response with no Content-Type: read as JSON, an event stream or text as its
    first bytes tell, whatever reads split them."""
    whole, r, _ = _run(data, "auto", [])
    assert r.mode == mode and whole == _run(data, mode, [])[0] and whole != data
    for i in range(1, len(data)):
        assert _run(data, "auto", [i])[0] == whole, i


@pytest.mark.parametrize("data, mode", [
    (b"data:9\\uff20e.com mail bob\\u0040example.org\n\n", "sse"),
    (b"mail bob\\u0040example.org or 4111\\u00201111 1111 1111", "text"),
    (b"escaped \\\\ then bob\\u0040example.org", "text"),
])
def test_escape_in_plain_text_any_split_gives_the_same_result(data: bytes, mode: str) -> None:
    """An escape outside JSON (a plain-text data: line, a text body) cut by a read (`\\`,
    `\\u`, `\\u00` at the end) is held until whole, as in a JSON string: split anywhere,
    the stream reads (and is masked) the same."""
    whole, r, _ = _run(data, mode, [])
    assert r.counts, whole
    for i in range(1, len(data)):
        assert _run(data, mode, [i])[0] == whole, (i, data[:i])
