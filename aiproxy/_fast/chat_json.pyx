# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The prompt text of an OpenAI-style JSON body, read straight from its bytes.

A chat request's text is its `messages[].content`, `prompt` or `input`. Parsing the
whole document into Python objects (orjson) and walking them was most of what reading
the text cost. `chat_text` finds the same strings in two passes over the bytes: one that
checks the whole body is RFC 8259 JSON (UTF-8 included) and notes where the three
top-level values are, one that decodes the strings wanted into one buffer.

It answers None where it might not read the body as json.loads does, and the caller
takes the general path (aiproxy.semantic.unified): not JSON, not an object, keys or
roles or part types with escapes in them, \\u escapes of a lone surrogate, nesting
deeper than MAX_DEPTH. tests/test_semantic_unified.py compares the two paths.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdlib cimport free, realloc

DEF MAX_DEPTH = 64
DEF MAX_PARTS = 256  # unified.MAX_TEXT_PARTS: parts joined, list items and turns read

ctypedef const unsigned char *cstr

# 1 for the bytes that end a plain run inside a string: quote, backslash, controls and
# the first byte of a UTF-8 sequence.
cdef unsigned char STOP[256]
for _c in range(256):
    STOP[_c] = _c == 34 or _c == 92 or _c < 32 or _c >= 128


cdef inline Py_ssize_t _ws(cstr s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and (s[i] == 32 or s[i] == 10 or s[i] == 13 or s[i] == 9):
        i += 1
    return i


cdef inline int _hex(unsigned char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef inline long _u4(cstr s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The code unit of the 4 hex digits at s[i:i+4], or -1."""
    cdef long v = 0
    cdef int d, k
    if i + 4 > n:
        return -1
    for k in range(4):
        d = _hex(s[i + k])
        if d < 0:
            return -1
        v = v * 16 + d
    return v


cdef Py_ssize_t _string(cstr s, Py_ssize_t i, Py_ssize_t n, unsigned char *out,
                        Py_ssize_t *out_len) noexcept nogil:
    """The JSON string at s[i] (a quote): the index after its closing quote, or -1 if
    it is not valid. Its decoded UTF-8 goes to out (when not NULL), its length to
    out_len. Decoded text is never longer than the JSON that spells it."""
    cdef unsigned char c, c1
    cdef long u, lo
    cdef Py_ssize_t o = 0
    cdef int j, k
    i += 1
    while True:
        # the plain run up to a quote, backslash, control or non-ASCII byte
        if out == NULL:
            while i < n and not STOP[s[i]]:
                i += 1
        else:
            while i < n and not STOP[s[i]]:
                out[o] = s[i]
                o += 1
                i += 1
        if i >= n:
            return -1
        c = s[i]
        if c == 34:
            out_len[0] = o
            return i + 1
        if c < 32:
            return -1
        if c == 92:
            if i + 1 >= n:
                return -1
            c1 = s[i + 1]
            i += 2
            if c1 == 117:  # \uXXXX
                u = _u4(s, i, n)
                if u < 0:
                    return -1
                i += 4
                if 0xDC00 <= u <= 0xDFFF:
                    return -1  # a lone low surrogate
                if 0xD800 <= u <= 0xDBFF:
                    if i + 6 > n or s[i] != 92 or s[i + 1] != 117:
                        return -1
                    lo = _u4(s, i + 2, n)
                    if lo < 0xDC00 or lo > 0xDFFF:
                        return -1
                    i += 6
                    u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)
                if out != NULL:
                    if u < 0x80:
                        out[o] = <unsigned char>u
                    elif u < 0x800:
                        out[o] = <unsigned char>(0xC0 | (u >> 6))
                        out[o + 1] = <unsigned char>(0x80 | (u & 0x3F))
                    elif u < 0x10000:
                        out[o] = <unsigned char>(0xE0 | (u >> 12))
                        out[o + 1] = <unsigned char>(0x80 | ((u >> 6) & 0x3F))
                        out[o + 2] = <unsigned char>(0x80 | (u & 0x3F))
                    else:
                        out[o] = <unsigned char>(0xF0 | (u >> 18))
                        out[o + 1] = <unsigned char>(0x80 | ((u >> 12) & 0x3F))
                        out[o + 2] = <unsigned char>(0x80 | ((u >> 6) & 0x3F))
                        out[o + 3] = <unsigned char>(0x80 | (u & 0x3F))
                o += 1 if u < 0x80 else 2 if u < 0x800 else 3 if u < 0x10000 else 4
                continue
            if c1 == 34 or c1 == 92 or c1 == 47:
                c = c1
            elif c1 == 98:
                c = 8
            elif c1 == 102:
                c = 12
            elif c1 == 110:
                c = 10
            elif c1 == 114:
                c = 13
            elif c1 == 116:
                c = 9
            else:
                return -1
            if out != NULL:
                out[o] = c
            o += 1
            continue
        # a UTF-8 sequence, checked as strictly as Python's decoder
        k = _utf8_len(s, i, n)
        if k < 0:
            return -1
        if out != NULL:
            for j in range(k):
                out[o + j] = s[i + j]
        o += k
        i += k


cdef inline int _utf8_len(cstr s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The length of the valid UTF-8 sequence (2-4 bytes) at s[i], or -1."""
    cdef unsigned char c = s[i]
    cdef unsigned char lo = 0x80, hi = 0xBF
    cdef int k, j
    if 0xC2 <= c <= 0xDF:
        k = 2
    elif 0xE0 <= c <= 0xEF:
        k = 3
        if c == 0xE0:
            lo = 0xA0
        elif c == 0xED:
            hi = 0x9F  # no surrogates
    elif 0xF0 <= c <= 0xF4:
        k = 4
        if c == 0xF0:
            lo = 0x90
        elif c == 0xF4:
            hi = 0x8F
    else:
        return -1
    if i + k > n or not lo <= s[i + 1] <= hi:
        return -1
    for j in range(2, k):
        if not 0x80 <= s[i + j] <= 0xBF:
            return -1
    return k


cdef inline Py_ssize_t _digits(cstr s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and 48 <= s[i] <= 57:
        i += 1
    return i


cdef Py_ssize_t _number(cstr s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? at s[i]: the index after, or -1."""
    cdef Py_ssize_t j
    if i < n and s[i] == 45:
        i += 1
    if i >= n:
        return -1
    if s[i] == 48:
        i += 1
    elif 49 <= s[i] <= 57:
        i = _digits(s, i, n)
    else:
        return -1
    if i < n and s[i] == 46:
        j = _digits(s, i + 1, n)
        if j == i + 1:
            return -1
        i = j
    if i < n and (s[i] == 101 or s[i] == 69):
        i += 1
        if i < n and (s[i] == 43 or s[i] == 45):
            i += 1
        j = _digits(s, i, n)
        if j == i:
            return -1
        i = j
    return i


cdef inline bint _word(cstr s, Py_ssize_t i, Py_ssize_t n, const char *w,
                       Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t j
    if i + k > n:
        return False
    for j in range(k):
        if s[i + j] != <unsigned char>w[j]:
            return False
    return True


cdef Py_ssize_t _value(cstr s, Py_ssize_t i, Py_ssize_t n, int depth) noexcept nogil:
    """Check the JSON value at s[i] (no leading whitespace): the index after it, or -1."""
    cdef Py_ssize_t o
    cdef unsigned char c
    if i >= n:
        return -1
    c = s[i]
    if c == 34:
        return _string(s, i, n, NULL, &o)
    if c == 123 or c == 91:  # { [
        if depth >= MAX_DEPTH:
            return -1
        i = _ws(s, i + 1, n)
        if i < n and s[i] == c + 2:  # } ]
            return i + 1
        while True:
            if c == 123:
                if i >= n or s[i] != 34:
                    return -1
                i = _string(s, i, n, NULL, &o)
                if i < 0:
                    return -1
                i = _ws(s, i, n)
                if i >= n or s[i] != 58:
                    return -1
                i = _ws(s, i + 1, n)
            i = _value(s, i, n, depth + 1)
            if i < 0:
                return -1
            i = _ws(s, i, n)
            if i >= n:
                return -1
            if s[i] == 44:
                i = _ws(s, i + 1, n)
            elif s[i] == c + 2:
                return i + 1
            else:
                return -1
    if c == 116:
        return i + 4 if _word(s, i, n, b"true", 4) else -1
    if c == 102:
        return i + 5 if _word(s, i, n, b"false", 5) else -1
    if c == 110:
        return i + 4 if _word(s, i, n, b"null", 4) else -1
    return _number(s, i, n)


cdef inline Py_ssize_t _skip_string(cstr s, Py_ssize_t i) noexcept nogil:
    """The index after the (checked) string at s[i]."""
    i += 1
    while s[i] != 34:
        i += 2 if s[i] == 92 else 1
    return i + 1


cdef Py_ssize_t _skip(cstr s, Py_ssize_t i) noexcept nogil:
    """The index after the (checked) value at s[i]: no checking, strings skipped."""
    cdef unsigned char c = s[i]
    cdef int depth
    if c == 34:
        return _skip_string(s, i)
    if c == 123 or c == 91:
        depth = 1
        i += 1
        while True:
            c = s[i]
            if c == 34:
                i = _skip_string(s, i)
                continue
            if c == 123 or c == 91:
                depth += 1
            elif c == 125 or c == 93:
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
    while not (c == 44 or c == 125 or c == 93 or c == 32 or c == 10 or c == 13 or c == 9):
        i += 1
        c = s[i]
    return i


# The walk over values already checked: each step names what it found.
cdef struct Members:
    Py_ssize_t i  # the next member's key (or the closing brace)
    Py_ssize_t key  # this member's key, after its quote
    Py_ssize_t key_len
    Py_ssize_t value  # this member's value


cdef inline int _next_member(cstr s, Py_ssize_t n, Members *m) noexcept nogil:
    """Step to an object's next member: 1 found (key and value noted), 0 the end, -1 a
    key with an escape in it (not compared here)."""
    cdef Py_ssize_t i = m.i, j
    if s[i] == 125:
        return 0
    j = i + 1
    while s[j] != 34:
        if s[j] == 92:
            return -1
        j += 1
    m.key = i + 1
    m.key_len = j - i - 1
    j = _ws(s, j + 1, n)  # the colon
    m.value = _ws(s, j + 1, n)
    j = _ws(s, _skip(s, m.value), n)  # a comma or the brace
    m.i = _ws(s, j + 1, n) if s[j] == 44 else j
    return 1


cdef inline void _open(cstr s, Py_ssize_t n, Py_ssize_t i, Members *m) noexcept nogil:
    """Start walking the object or array at s[i]."""
    m.i = _ws(s, i + 1, n)


cdef inline int _next_item(cstr s, Py_ssize_t n, Members *m) noexcept nogil:
    """Step to an array's next item (noted in m.value): 1 found, 0 the end."""
    cdef Py_ssize_t i = m.i, j
    if s[i] == 93:
        return 0
    m.value = i
    j = _ws(s, _skip(s, i), n)
    m.i = _ws(s, j + 1, n) if s[j] == 44 else j
    return 1


cdef inline bint _is(cstr s, Py_ssize_t at, Py_ssize_t length, const char *w,
                     Py_ssize_t k) noexcept nogil:
    return length == k and _word(s, at, at + k, w, k)


cdef struct Out:
    unsigned char *buf
    Py_ssize_t len
    int parts  # parts seen (the first MAX_PARTS are joined)
    bint wrote  # a non-empty part is in buf


cdef inline void _part(cstr s, Py_ssize_t n, Py_ssize_t i, Out *out) noexcept nogil:
    """A string value as one more part: joined with "\\n" when not empty."""
    cdef Py_ssize_t o, start
    if out.parts >= MAX_PARTS:
        return
    out.parts += 1
    start = out.len + 1 if out.wrote else out.len
    _string(s, i, n, out.buf + start, &o)
    if o:
        if out.wrote:
            out.buf[out.len] = 10
        out.len = start + o
        out.wrote = True


cdef void _strings(cstr s, Py_ssize_t n, Py_ssize_t i, Out *out) noexcept nogil:
    """unified._strings: a string, or the strings among a list's first items."""
    cdef Members m
    cdef int k = 0
    if s[i] == 34:
        _part(s, n, i, out)
    elif s[i] == 91:
        _open(s, n, i, &m)
        while k < MAX_PARTS and _next_item(s, n, &m):
            if s[m.value] == 34:
                _part(s, n, m.value, out)
            k += 1


cdef int _content(cstr s, Py_ssize_t n, Py_ssize_t i, Out *out) noexcept nogil:
    """A message's content: a string, or the text parts of a list. -1: an escaped key
    or part type."""
    cdef Members m, p
    cdef Py_ssize_t text
    cdef int r
    cdef bint kind
    if s[i] == 34:
        _part(s, n, i, out)
        return 0
    if s[i] != 91:
        return 0
    _open(s, n, i, &m)
    while _next_item(s, n, &m):
        if s[m.value] != 123:
            continue
        _open(s, n, m.value, &p)
        kind = False
        text = -1
        while True:  # the last "type" and "text" count, as in a parsed object
            r = _next_member(s, n, &p)
            if r < 0:
                return -1
            if r == 0:
                break
            if _is(s, p.key, p.key_len, b"type", 4):
                r = _string_is(s, p.value, b"text", 4)
                if r == 0:
                    r = _string_is(s, p.value, b"input_text", 10)
                if r < 0:
                    return -1
                kind = r == 1
            elif _is(s, p.key, p.key_len, b"text", 4):
                text = p.value
        if kind and text >= 0 and s[text] == 34:
            _part(s, n, text, out)
    return 0


cdef inline int _string_is(cstr s, Py_ssize_t i, const char *w, Py_ssize_t k) noexcept nogil:
    """Is the (checked) value at s[i] the string w: 1 yes, 0 no (or not a string), -1 a
    string with an escape in it (not compared here)."""
    cdef Py_ssize_t j
    if s[i] != 34:
        return 0
    if _has_escape(s, i):
        return -1
    j = i + 1
    while s[j] != 34:
        j += 1
    return _is(s, i + 1, j - i - 1, w, k)


cdef inline bint _has_escape(cstr s, Py_ssize_t i) noexcept nogil:
    cdef Py_ssize_t j = i + 1
    while s[j] != 34:
        if s[j] == 92:
            return True
        j += 1
    return False


cdef int _messages(cstr s, Py_ssize_t n, Py_ssize_t i, Out *out) noexcept nogil:
    """unified._messages: the user turns' content (all turns' without a user turn), the
    last MAX_PARTS of them. -1: an escaped key or role, or no memory."""
    cdef Members m, t
    cdef Py_ssize_t *content = NULL
    cdef void *grown
    cdef char *user = NULL
    cdef Py_ssize_t count = 0, cap = 0, users = 0, k, chosen, skip
    cdef int r, result = 0
    cdef Py_ssize_t c
    cdef bint is_user
    _open(s, n, i, &m)
    while _next_item(s, n, &m):
        if s[m.value] != 123:
            continue
        _open(s, n, m.value, &t)
        c = -1
        is_user = False
        while True:  # the last "role" and "content" count
            r = _next_member(s, n, &t)
            if r < 0:
                result = -1
                break
            if r == 0:
                break
            if _is(s, t.key, t.key_len, b"role", 4):
                r = _string_is(s, t.value, b"user", 4)
                if r < 0:
                    result = -1
                    break
                is_user = r == 1
            elif _is(s, t.key, t.key_len, b"content", 7):
                c = t.value
        if result < 0:
            break
        if count == cap:
            cap = cap * 2 if cap else 16
            grown = realloc(content, cap * sizeof(Py_ssize_t))
            if grown == NULL:
                result = -1
                break
            content = <Py_ssize_t *>grown
            grown = realloc(user, cap)
            if grown == NULL:
                result = -1
                break
            user = <char *>grown
        content[count] = c
        user[count] = is_user
        users += is_user
        count += 1
    if result == 0:
        chosen = users if users else count
        skip = chosen - MAX_PARTS if chosen > MAX_PARTS else 0
        for k in range(count):
            if users and not user[k]:
                continue
            if skip:
                skip -= 1
                continue
            if content[k] >= 0 and _content(s, n, content[k], out) < 0:
                result = -1
                break
    free(content)
    free(user)
    return result


def chat_text(bytes body not None):
    """The text unified.extract_text finds in a JSON body (no json_fields), or None when
    this reader cannot tell (the general path decides)."""
    cdef cstr s = <cstr>body
    cdef Py_ssize_t n = len(body), i, end, o, key, key_len, value
    cdef Py_ssize_t messages = -1, prompt = -1, inp = -1
    cdef Out out
    # The root object, checked member by member; the last of each key counts, as in a
    # parsed object.
    i = _ws(s, 0, n)
    if i >= n or s[i] != 123:
        return None
    i = _ws(s, i + 1, n)
    if i < n and s[i] == 125:
        i += 1
    else:
        while True:
            if i >= n or s[i] != 34:
                return None
            end = _string(s, i, n, NULL, &o)
            if end < 0 or _has_escape(s, i):
                return None
            key = i + 1
            key_len = end - i - 2
            i = _ws(s, end, n)
            if i >= n or s[i] != 58:
                return None
            value = _ws(s, i + 1, n)
            i = _value(s, value, n, 1)
            if i < 0:
                return None
            if _is(s, key, key_len, b"messages", 8):
                messages = value
            elif _is(s, key, key_len, b"prompt", 6):
                prompt = value
            elif _is(s, key, key_len, b"input", 5):
                inp = value
            i = _ws(s, i, n)
            if i >= n:
                return None
            if s[i] == 125:
                i += 1
                break
            if s[i] != 44:
                return None
            i = _ws(s, i + 1, n)
    if _ws(s, i, n) != n:
        return None
    out.buf = <unsigned char *>PyMem_Malloc(n + MAX_PARTS + 1)
    if out.buf == NULL:
        raise MemoryError()
    out.len = 0
    out.parts = 0
    out.wrote = False
    try:
        if messages >= 0 and s[messages] == 91:
            if _messages(s, n, messages, &out) < 0:
                return None
        if prompt >= 0:
            _strings(s, n, prompt, &out)
        if inp >= 0:
            if s[inp] == 91 and s[_ws(s, inp + 1, n)] == 123:
                if _messages(s, n, inp, &out) < 0:
                    return None
            else:
                _strings(s, n, inp, &out)
        return PyUnicode_DecodeUTF8(<char *>out.buf, out.len, NULL)
    finally:
        PyMem_Free(out.buf)
