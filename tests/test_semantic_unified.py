"""UnifiedRequest extraction: OpenAI JSON, protobuf/gRPC without schema, image and audio
headers, query strings; truncated input at every length never raises."""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import wave
import zlib

import pytest
from aiproxy._fast.chat_json import chat_text

from aiproxy.semantic.unified import (
    Modality,
    _json_text,
    extract,
    extract_text,
    protobuf_strings,
    sniff_media,
)

# ------------------------------------------------------------------ sample payloads


def png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + b"\x00\x00\x00" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def gif(width: int, height: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00"
            + b"\xff\xff\xff\x00\x00\x00"
            + b"," + struct.pack("<HHHH", 0, 0, width, height) + b"\x00"
            + b"\x02\x02D\x01\x00;")


def jpeg(width: int, height: int) -> bytes:
    def seg(marker: int, data: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(data) + 2) + data

    app0 = seg(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    dqt = seg(0xDB, b"\x00" + bytes(range(1, 65)))
    sof = seg(0xC0, struct.pack(">BHHB", 8, height, width, 3)
              + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01")
    dht = seg(0xC4, b"\x00" + bytes([0, 1] + [0] * 14) + b"\x00")
    sos = seg(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
    return b"\xff\xd8" + app0 + dqt + sof + dht + sos + b"\x00\x01\x02" + b"\xff\xd9"


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    payload = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(payload)) + b"WEBP" + b"VP8L" + struct.pack(
        "<I", len(payload)) + payload


def webp_lossy(width: int, height: int) -> bytes:
    payload = b"\x50\x01\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height) + b"\x00" * 10
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(payload)) + b"WEBP" + b"VP8 " + struct.pack(
        "<I", len(payload)) + payload


def webp_extended(width: int, height: int) -> bytes:
    payload = b"\x10\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(payload)) + b"WEBP" + b"VP8X" + struct.pack(
        "<I", len(payload)) + payload


def wav(rate: int, channels: int, seconds: float) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * channels * int(rate * seconds))
    return buf.getvalue()


def flac(rate: int, channels: int, total_samples: int) -> bytes:
    packed = (rate << 44) | ((channels - 1) << 41) | ((16 - 1) << 36) | total_samples
    streaminfo = struct.pack(">HH", 4096, 4096) + b"\x00\x00\x00" + b"\x00\x00\x00" + struct.pack(
        ">Q", packed) + b"\x00" * 16
    return b"fLaC" + bytes([0x80]) + len(streaminfo).to_bytes(3, "big") + streaminfo


def mp3(frames: int) -> bytes:
    # MPEG-1 Layer III, 128 kbit/s, 44.1 kHz, joint stereo: 417-byte frames
    header = b"\xff\xfb\x90\x64"
    id3 = b"ID3\x04\x00\x00\x00\x00\x00\x0a" + b"\x00" * 10
    return id3 + (header + b"\x00" * 413) * frames


def ogg_opus(seconds: float, channels: int = 2) -> bytes:
    def page(granule: int, seq: int, packet: bytes, kind: int) -> bytes:
        return (b"OggS\x00" + bytes([kind]) + struct.pack("<qIII", granule, 1234, seq, 0)
                + bytes([1, len(packet)]) + packet)

    head = b"OpusHead\x01" + bytes([channels]) + struct.pack("<HIhB", 312, 16000, 0, 0)
    return (page(0, 0, head, 2) + page(0, 1, b"OpusTags" + b"\x00" * 8, 0)
            + page(int(seconds * 48000) + 312, 2, b"\x00" * 20, 4))


def ogg_vorbis(rate: int = 44100, channels: int = 1) -> bytes:
    ident = b"\x01vorbis" + struct.pack("<IBIiiiBB", 0, channels, rate, 0, 128000, 0, 0xB8, 1)
    return b"OggS\x00\x02" + struct.pack("<qIII", 0, 1, 0, 0) + bytes([1, len(ident)]) + ident


def chat_proto_class():
    """A real protobuf message type built from a descriptor (no generated code)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="chat_test.proto", package="aiproxytest",
                                             syntax="proto3")
    msg = fdp.message_type.add(name="Message")
    msg.field.add(name="role", number=1, type=9, label=1)
    msg.field.add(name="content", number=2, type=9, label=1)
    req = fdp.message_type.add(name="ChatRequest")
    req.field.add(name="model", number=1, type=9, label=1)
    req.field.add(name="messages", number=2, type=11, label=3, type_name=".aiproxytest.Message")
    req.field.add(name="max_tokens", number=3, type=5, label=1)
    req.field.add(name="temperature", number=4, type=2, label=1)
    req.field.add(name="blob", number=5, type=12, label=1)
    req.field.add(name="seed", number=6, type=6, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("aiproxytest.ChatRequest"))


@pytest.fixture(scope="module")
def chat_bytes() -> bytes:
    cls = chat_proto_class()
    m = cls(model="small-llm", max_tokens=256, temperature=0.5, blob=bytes(range(256)) * 2,
            seed=2**40)
    m.messages.add(role="user", content="transfer 100 dollars to my savings account")
    m.messages.add(role="assistant", content="Sure — from which account? ✓")
    return m.SerializeToString()


# ------------------------------------------------------------------ JSON


def test_openai_chat_messages():
    body = json.dumps({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are a helpful banking assistant."},
            {"role": "user", "content": "what is my checking balance"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "user", "content": [
                {"type": "text", "text": "and my savings?"},
                {"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(png(4, 3)).decode()}},
            ]},
        ],
    }).encode()
    r = extract(b"application/json; charset=utf-8", body, request_id="r1")
    assert r.id == "r1" and r.modality == Modality.TEXT
    assert r.text == "what is my checking balance\nand my savings?"
    assert r.metadata["model"] == "gpt-4o-mini" and r.metadata["content_type"] == "application/json"
    assert r.metadata["body_size"] == len(body) and r.metadata["images"] == 1
    assert r.metadata["image_meta"] == {"kind": "image", "format": "png", "width": 4, "height": 3}


def test_prompt_input_and_configured_fields():
    r = extract(b"application/json", json.dumps({"prompt": "say hi", "x": 1}).encode())
    assert r.text == "say hi"
    r = extract(b"application/json", json.dumps({"prompt": ["one", "two", 3]}).encode())
    assert r.text == "one\ntwo"
    r = extract(b"application/json", json.dumps({"input": "embed me"}).encode())
    assert r.text == "embed me"
    r = extract(b"application/json", json.dumps({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "responses api"}]}]}).encode())
    assert r.text == "responses api"
    doc = {"query": {"q": "find hotels"}, "tags": ["a", "b"], "n": 5, "items": [{"t": "x"}]}
    r = extract(b"application/json", json.dumps(doc).encode(),
                json_fields=("query.q", "tags", "n", "missing.path", "items.0.t"))
    assert r.text == "find hotels\na\nb\nx"
    assert r.id and len(r.id) == 16


def test_query_string_and_plain_text():
    r = extract(b"", b"", b"?q=weather+in+paris&lang=en&empty=")
    assert r.text == "weather in paris\nen" and r.modality == Modality.TEXT
    r = extract(b"text/plain", "héllo wörld".encode(), b"")
    assert r.text == "héllo wörld"
    r = extract(b"application/x-www-form-urlencoded", b"message=book+a+table&x=1")
    assert r.text == "book a table\n1"


def test_every_json_media_type():
    body = json.dumps({"messages": [{"role": "user", "content": "hi there"}]}).encode()
    for ctype in (b"application/x-json", b"application/vnd.api+json", b" Application/JSON "):
        assert extract_text(ctype, body) == extract(ctype, body).text == "hi there", ctype


def test_multipart_form():
    """An upload (OpenAI's /v1/audio/transcriptions, say): text fields and JSON parts
    are read, an audio or image file is sniffed."""
    import httpx  # builds the multipart body as a client does

    req = httpx.Request("POST", "http://x/v1/audio/transcriptions", data={
        "prompt": "a call about my mortgage"}, files={
        "file": ("a.wav", wav(16000, 1, 0.25), "audio/wav"),
        "meta": ("m.json", json.dumps({"prompt": "from json"}).encode(), "application/json"),
        "blob": ("x.bin", b"\x00\x01text-looking", "application/octet-stream")})
    body = req.read()
    r = extract(req.headers["content-type"].encode(), body)
    assert r.text == "a call about my mortgage\nfrom json"
    assert r.modality == Modality.AUDIO and r.metadata["sample_rate"] == 16000
    assert r.metadata["parts"] == 4
    # Cut at the inspect limit: what arrived is read, nothing raises.
    cut = extract(req.headers["content-type"].encode(), body[:len(body) // 2])
    assert cut.text.startswith("a call about my mortgage")
    base64_part = (b"--b\r\nContent-Disposition: form-data; name=q\r\n"
                   b"Content-Transfer-Encoding: base64\r\n\r\n" + base64.b64encode(b"hidden words")
                   + b"\r\n--b--\r\n")
    assert extract_text(b"multipart/form-data; boundary=b", base64_part) == "hidden words"
    assert extract_text(b"multipart/form-data", base64_part) == ""  # no boundary


def test_truncated_json_is_read_leniently():
    body = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "first question about \"quoted\" things"},
        {"role": "user", "content": "a second long question " + "x" * 200}]}).encode()
    r = extract(b"application/json", body[:120], body_size=len(body))
    assert r.metadata["json"] == "partial" and r.metadata["truncated"] is True
    assert r.text.startswith('first question about "quoted" things')
    assert r.metadata["body_size"] == len(body)


# ------------------------------------------------------------------ protobuf / gRPC


def test_protobuf_without_schema(chat_bytes):
    out: list[str] = []
    assert protobuf_strings(chat_bytes, out)
    assert "small-llm" in out and "transfer 100 dollars to my savings account" in out
    assert "Sure — from which account? ✓" in out and "user" in out
    assert not any("\x00" in s for s in out)  # the bytes field is not text
    r = extract(b"application/x-protobuf", chat_bytes)
    assert r.modality == Modality.TEXT and "transfer 100 dollars" in r.text


def test_grpc_frames(chat_bytes):
    frame = b"\x00" + struct.pack(">I", len(chat_bytes)) + chat_bytes
    r = extract(b"application/grpc+proto", frame + frame)
    assert r.metadata["grpc_frames"] == 2
    assert r.text.count("transfer 100 dollars to my savings account") == 2
    # compressed frames are not decoded
    r = extract(b"application/grpc", b"\x01" + struct.pack(">I", 3) + b"abc")
    assert r.metadata.get("grpc_compressed") and r.modality == Modality.BINARY


def test_protobuf_struct_well_known_type():
    from google.protobuf import struct_pb2

    s = struct_pb2.Struct()
    s.update({"question": "where is my package", "n": 3, "nested": {"k": "deep value"}})
    out: list[str] = []
    protobuf_strings(s.SerializeToString(), out)
    assert "where is my package" in out and "deep value" in out


# ------------------------------------------------------------------ media


@pytest.mark.parametrize("make,fmt", [(png, "png"), (gif, "gif"), (jpeg, "jpeg"),
                                      (webp_lossless, "webp"), (webp_lossy, "webp"),
                                      (webp_extended, "webp")])
def test_image_headers(make, fmt):
    data = make(321, 123)
    r = extract(b"image/" + fmt.encode(), data)
    assert r.modality == Modality.IMAGE and r.text == ""
    assert (r.metadata["format"], r.metadata["width"], r.metadata["height"]) == (fmt, 321, 123)
    # the declared content type does not matter: the header does
    assert extract(b"application/octet-stream", data).metadata["width"] == 321


def test_wav():
    data = wav(16000, 2, 0.5)
    r = extract(b"audio/wav", data)
    assert r.modality == Modality.AUDIO
    m = r.metadata
    assert (m["format"], m["sample_rate"], m["channels"]) == ("wav", 16000, 2)
    assert m["duration"] == pytest.approx(0.5)
    # only the header inspected: duration still comes from the data chunk's size
    r = extract(b"audio/wav", data[:64], body_size=len(data))
    assert r.metadata["duration"] == pytest.approx(0.5)


def test_flac_mp3_ogg():
    m = sniff_media(flac(44100, 2, 44100 * 3), None)
    assert (m["format"], m["sample_rate"], m["channels"], m["duration"]) == ("flac", 44100, 2, 3.0)
    data = mp3(100)
    m = extract(b"audio/mpeg", data).metadata
    assert (m["format"], m["sample_rate"], m["channels"], m["bitrate_kbps"]) == ("mp3", 44100, 2, 128)
    assert m["duration"] == pytest.approx(100 * 417 * 8 / 128000, rel=1e-3)
    m = extract(b"audio/ogg", ogg_opus(2.0)).metadata
    assert (m["codec"], m["channels"], m["sample_rate"], m["duration"]) == ("opus", 2, 16000, 2.0)
    m = sniff_media(ogg_vorbis(22050, 1), None)
    assert (m["codec"], m["sample_rate"], m["channels"]) == ("vorbis", 22050, 1)


def test_unknown_binary():
    r = extract(b"application/octet-stream", bytes(range(256)))
    assert r.modality == Modality.BINARY and r.text == ""
    r = extract(b"", b"")
    assert r.modality == Modality.TEXT and r.text == "" and r.metadata["body_size"] == 0


# ------------------------------------------------------------------ truncation


def _samples(chat: bytes) -> list[tuple[bytes, bytes]]:
    grpc = b"\x00" + struct.pack(">I", len(chat)) + chat
    openai = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi \\ \"there\" \u00e9"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,"
                                            + base64.b64encode(jpeg(9, 9)).decode()}}]}]}).encode()
    return [
        (b"application/json", openai),
        (b"application/x-protobuf", chat),
        (b"application/grpc", grpc),
        (b"image/png", png(5, 5)), (b"image/gif", gif(5, 5)), (b"image/jpeg", jpeg(5, 5)),
        (b"image/webp", webp_lossless(5, 5)), (b"image/webp", webp_lossy(5, 5)),
        (b"image/webp", webp_extended(5, 5)),
        (b"audio/wav", wav(8000, 1, 0.01)), (b"audio/flac", flac(8000, 1, 80)),
        (b"audio/mpeg", mp3(2)), (b"audio/ogg", ogg_opus(0.1)), (b"audio/ogg", ogg_vorbis()),
        (b"application/octet-stream", chat), (b"text/plain", "héllo".encode()),
    ]


def test_truncated_input_never_raises(chat_bytes):
    for ctype, data in _samples(chat_bytes):
        for cut in range(len(data) + 1):
            r = extract(ctype, data[:cut], b"a=%ff&b", body_size=len(data))
            assert isinstance(r.text, str) and r.metadata["body_size"] == len(data)
            # the router's text-only path finds the same text
            assert extract_text(ctype, data[:cut], b"a=%ff&b", body_size=len(data)) == r.text


def test_extract_text_is_extracts_text():
    bodies = [
        (b"application/json", json.dumps({"messages": [
            {"role": "user", "content": "one"}, {"role": "user", "content": ""},
            {"role": "user", "content": "two"}]}).encode(), b""),
        (b"application/json", json.dumps({"prompt": "only this"}).encode(), b""),
        (b"application/json", json.dumps({"prompt": ""}).encode(), b"?q=from+query"),
        (b"text/plain", b"", b""),
        (b"", b"", b"?q=weather+in+paris&lang=en&empty="),
        (b"application/x-www-form-urlencoded", b"message=book+a+table&x=1", b"y=2"),
    ]
    for ctype, body, query in bodies:
        assert extract_text(ctype, body, query) == extract(ctype, body, query).text


def test_json_fast_path_finds_what_extract_finds():
    """extract_text reads a JSON body without building the metadata; whatever the body
    (whole or cut anywhere, valid or not), its text is extract's."""
    image = "data:image/png;base64," + base64.b64encode(png(3, 2)).decode()
    docs = [
        {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "book a table for two"},
                                    {"role": "assistant", "content": "where?"},
                                    {"role": "user", "content": "in paris \u00e9 \ud83d\ude00"}]},
        {"messages": [{"role": "system", "content": "no user turn"}, "junk", 3]},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "input_text", "text": "and this"}, "loose", {"type": "text", "text": 5}]}]},
        {"prompt": ["first", 2, "second"], "input": "also"},
        {"input": [{"role": "user", "content": "responses api"}], "prompt": None},
        {"input": [], "messages": "not a list", "prompt": {"nested": "no"}},
        {"config": {"query": "configured field", "items": ["a", "b"]}, "prompt": ""},
        ["a list root"], "a string root", 12, None, {},
    ]
    bodies = [json.dumps(d).encode() for d in docs] + [
        b'{"prompt": "nan", "x": NaN}', b'{"prompt": "big", "n": 123456789012345678901234567890}',
        b'{"prompt": "bad utf-8 \xff"}', b'{"prompt": "lone \\ud800 surrogate"}',
        b'{"prompt": "dup", "prompt": "second wins"}', b'  {"prompt": "spaces"}  ', b"[1, 2",
    ]
    bodies += [json.dumps(d, ensure_ascii=False, indent=1).encode("utf-8", "surrogatepass")
               for d in docs[:5]] + [
        b'{"messages": [{"role": "user", "role": "system", "content": "a"},'
        b' {"role": "user", "content": "b", "content": "last content wins"}]}',
        b'{"messages": [{"role": "us\\u0065r", "content": "escaped role"}]}',
        b'{"mess\\u0061ges": [{"role": "user", "content": "escaped key"}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "te\\u0078t", "text": "x"}]}]}',
        b'{"prompt": "\\u00e9\\ud83d\\ude00 \\"q\\" \\\\ \\/ \\b\\f\\n\\r\\t \\u0000"}',
        b'{"prompt": "low first \\udc00"}', b'{"prompt": "high then text \\ud83dx"}',
        b'{"prompt": "overlong \xc0\xaf"}', b'{"prompt": "utf-8 surrogate \xed\xa0\x80"}',
        b'{"prompt": "past U+10FFFF \xf4\x90\x80\x80"}', b'{"prompt": "ctl \x01"}',
        b'{"prompt": "x"} trailing', b'{"prompt": "x",}', b'{"prompt": 01}', b'{"prompt": 1.}',
        b'{"prompt": -}', b'{"prompt": tru}', b'{"a": [1, 2.5e-3, -0, true, false, null]}',
        b'{"prompt": "deep", "d": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"messages": [' + b", ".join(b'{"role": "user", "content": "%d"}' % i
                                      for i in range(300)) + b"]}",
    ]
    fields = ("config.query", "config.items", "config.items.1", "missing.path")
    for ctype in (b"application/json", b"application/vnd.api+json; charset=utf-8", b""):
        for body in bodies:
            cuts = range(len(body) + 1) if len(body) < 1000 else range(0, len(body) + 1, 97)
            for cut in (*cuts, len(body)):
                for json_fields in ((), fields):
                    want = extract(ctype, body[:cut], b"", json_fields).text
                    assert extract_text(ctype, body[:cut], b"", json_fields) == want, (
                        ctype, body[:cut], json_fields)


def test_chat_text_reads_the_bytes_as_the_parsed_document():
    """The C reader answers for the common bodies, and with the parsed document's text;
    where it cannot be sure (escaped keys, roles or types; invalid JSON) it says None."""
    chat = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "caf\u00e9 \U0001F600"}]}]})
    for body in (chat.encode(), json.dumps(json.loads(chat), ensure_ascii=False).encode()):
        assert chat_text(body) == "caf\u00e9 \U0001F600" == _json_text(body, ())
    assert chat_text(b'{"input": ["a", 1, "b"], "prompt": "p"}') == "p\na\nb"
    for declined in (b'{"mess\\u0061ges": []}', b'{"messages": [{"role": "\\u0075ser"}]}',
                     b'["root"]', b'{"prompt": "x"', b'{"prompt": "\xff"}',
                     b'{"prompt": "\\ud800"}', b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}"):
        assert chat_text(declined) is None, declined
    # random documents, encoded several ways and damaged: whenever it answers, it agrees
    rng = random.Random(11)
    words = ["hi", "caf\u00e9", "\U0001F600", 'q"uote', "back\\slash", "nl\n", "\u0000", ""]

    def value(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice([None, True, 0, -1.5e300, 2 ** 70, *words])
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["role", "content", "type", "text", "x"]): value(depth + 1)
                for _ in range(rng.randrange(4))}

    def message():
        return {"role": rng.choice(["user", "system", None]),
                "content": rng.choice([*words, [{"type": rng.choice(["text", "input_text",
                                                                     "image_url"]),
                                                 "text": rng.choice([*words, 5])}
                                                for _ in range(rng.randrange(3))], value()])}

    answered = 0
    for _ in range(3000):
        doc = {"model": "m", "messages": rng.choice([[message() for _ in range(3)], value()]),
               "prompt": rng.choice([rng.choice(words), [rng.choice(words)] * 2, value()]),
               "input": rng.choice([[message()], value()])}
        body = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        if rng.random() < 0.3:
            i = rng.randrange(len(body))
            body = body[:i] + rng.choice([b"\\", b'"', b"\xed\xa0\x80", b"}", b""]) + body[i + 1:]
        got = chat_text(body)
        if got is not None:
            answered += 1
            want = _json_text(body, ())
            assert got == (want if want is not None else extract(b"application/json", body).text)
    assert answered > 2000


def test_garbage_never_raises():
    import random

    rng = random.Random(7)
    prefixes = [b"", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBP",
                b"RIFF\x00\x00\x00\x00WAVE", b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"{\"messages\":"]
    for i in range(600):
        data = prefixes[i % len(prefixes)] + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        for ctype in (b"application/json", b"application/grpc", b"application/x-protobuf",
                      b"application/octet-stream", b"image/png", b"audio/wav"):
            extract(ctype, data)


def _mime_work(fn, *args):
    """fn(*args), and how much the stdlib MIME parser did meanwhile: messages it made
    (one per part it parsed) and lines it read one by one in Python."""
    import email.feedparser
    import email.message
    import sys

    counted = {email.message.Message.__init__.__code__: "messages",
               email.feedparser.BufferedSubFile.readline.__code__: "lines"}
    work = {"messages": 0, "lines": 0}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in counted:
            work[counted[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, work


def _tiny_parts(size: int, boundary: bytes = b"b") -> bytes:
    """A multipart body of `size` bytes or less, of as many one-word fields as fit."""
    out, i = [], 0
    used = len(boundary) + 6  # the close delimiter
    while True:
        part = b"--%s\r\nContent-Disposition: form-data; name=\"f%d\"\r\n\r\nw%d\r\n" % (
            boundary, i, i)
        if used + len(part) > size:
            return b"".join(out) + b"--" + boundary + b"--\r\n"
        out.append(part)
        used += len(part)
        i += 1


def test_multipart_work_is_bounded():
    """A 64 KiB body of over a thousand tiny parts took ~88 ms on the event loop to read
    (the MIME parser makes a message per part and reads every line in Python): only the
    first MAX_FORM_PARTS (64) parts are parsed, and only their header blocks line by
    line. The work is counted, not timed."""
    from aiproxy.semantic.unified import MAX_FORM_PARTS

    ctype = b"multipart/form-data; boundary=b"
    body = _tiny_parts(65536)
    assert body.count(b"\r\n--b\r\n") > 1000
    r, work = _mime_work(extract, ctype, body)
    assert r.metadata["parts"] == MAX_FORM_PARTS and r.metadata["parts_cut"] is True
    assert r.text.split("\n") == [f"w{i}" for i in range(MAX_FORM_PARTS)]
    assert work["messages"] <= MAX_FORM_PARTS + 2, work
    assert work["lines"] <= 4 * MAX_FORM_PARTS + 8, work
    # A body of MAX_FORM_PARTS parts is read whole.
    body = b"".join(b"--b\r\n\r\nw%d\r\n" % i for i in range(MAX_FORM_PARTS)) + b"--b--\r\n"
    r = extract(ctype, body)
    assert r.metadata["parts"] == MAX_FORM_PARTS and "parts_cut" not in r.metadata
    # One text part of many lines, and a nested multipart of many parts (no text: not
    # walked): a regex scan each, not a Python step per line or per nested part.
    lines = b"--b\r\nContent-Type: text/plain\r\n\r\n" + b"line\n" * 12000 + b"\r\n--b--\r\n"
    r, work = _mime_work(extract, ctype, lines)
    assert r.text == "line\n" * 12000 and work["lines"] < 16, work
    nested = (b"--b\r\nContent-Type: multipart/mixed; boundary=c\r\n\r\n"
              + b"--c\r\n\r\nx\r\n" * 5000 + b"--c--\r\n--b\r\n\r\nouter\r\n--b--\r\n")
    r, work = _mime_work(extract, ctype, nested)
    assert r.text == "outer" and r.metadata["parts"] == 2
    assert work["messages"] < 8 and work["lines"] < 16, work
    # The boundary string inside the content past the bound: not all of it is read.
    stray = b"--b\r\n\r\n" + b"x--b\r\n" * 100 + b"\r\n--b--\r\n"
    assert extract(ctype, stray).metadata["parts_cut"] is True
