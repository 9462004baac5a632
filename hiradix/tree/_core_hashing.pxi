# Included by _core.pyx (one module: these are its module-level definitions).
# Page hashing: chained SHA-256 over token pages (``_sha256.h``), bit-compatible with SGLang.

def get_hash_str(token_ids, prior_hash=None):
    """SHA-256 of one page chained on ``prior_hash`` (SGLang's ``get_hash_str``).

    >>> get_hash_str([1, 2, 3, 4])
    'cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72'
    """
    cdef cnp.ndarray toks = _as_tokens(token_ids)
    n = cnp.PyArray_SIZE(toks)
    if n == 0:
        h = hashlib.sha256(bytes.fromhex(prior_hash) if prior_hash else b"")
        return h.hexdigest()
    return page_hashes(toks, n, prior_hash)[0]


def page_digests(tokens, Py_ssize_t page_size, prior_hash=None):
    """Chained digests of every full page of ``tokens`` as an ``(n_pages, 32)`` uint8
    array. Runs in C (SHA-NI when the CPU has it) without the GIL. ``O(len(tokens))``."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    cdef cnp.ndarray toks = _as_tokens(tokens)
    cdef size_t pages = <size_t>(cnp.PyArray_SIZE(toks) // page_size)
    cdef bytes prev_bytes = bytes.fromhex(prior_hash) if prior_hash else b""
    if prior_hash and len(prev_bytes) != DIGEST:
        raise ValueError("prior_hash must be 64 hex digits")
    cdef cnp.ndarray out = np.empty((pages, DIGEST), dtype=np.uint8)
    cdef const uint8_t* prev = <const uint8_t*>prev_bytes if prior_hash else NULL
    cdef const int32_t* src = <const int32_t*>cnp.PyArray_DATA(toks)
    cdef uint8_t* dst = <uint8_t*>cnp.PyArray_DATA(out)
    with nogil:
        hr_hash_pages(src, pages, <size_t>page_size, prev, dst)
    return out


def page_hashes(tokens, Py_ssize_t page_size, prior_hash=None):
    """Chained hashes (lowercase hex) of every full page of ``tokens``."""
    digests = page_digests(tokens, page_size, prior_hash)
    return [row.tobytes().hex() for row in digests]


def namespace_seed(str extra_key):
    """Digest that seeds the hash chain of a namespace (hex)."""
    return hashlib.sha256(b"hiradix-namespace\x00" + extra_key.encode()).hexdigest()


def sha256_accelerated():
    """Whether page hashing uses the CPU's SHA extensions."""
    return bool(hr_sha256_accelerated())


def _test_set_portable_sha256(bint on):
    """Force the portable SHA-256 path (tests compare both paths)."""
    hr_sha256_set_portable(on)
