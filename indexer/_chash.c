/* The index's and the router hash's C code, nothing else (the router's own helpers are in
 * router/_native.c): chain_hashes (same function as the pure-Python fallback in
 * indexer.hashing, tests assert they agree; it reads the Python list of token ids directly, so no
 * bytes conversion sits on the /route and ingest hot paths), chain_hashes_json (the same hash
 * over a JSON token array), the MaskMap presence table and the store/remove/walk hot loops that
 * indexer.index.native picks. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xC2B2AE3D27D4EB4FULL
#define K3 0x165667B19E3779F9ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

/* Token ids are small non-negative ints: read them without the generic conversion call. */
static inline int small_token(PyObject *item, uint64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 1;
    }
    return 0;
#else
    if (Py_SIZE(item) == 1) {
        *out = (uint64_t)((PyLongObject *)item)->ob_digit[0];
        return 1;
    }
    return Py_SIZE(item) == 0 ? (*out = 0, 1) : 0;
#endif
}

static PyObject *chain_hashes(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t bs;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "OnK", &seq, &bs, &parent)) return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "token_ids must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t nb = n / bs;
    PyObject *out = PyList_New(nb);
    if (out == NULL) { Py_DECREF(fast); return NULL; }
    uint64_t h = (uint64_t)parent;
    for (Py_ssize_t b = 0; b < nb; b++) {
        uint64_t x = h ^ K3;
        PyObject **blk = items + b * bs;
        for (Py_ssize_t k = 0; k < bs; k++) {
            PyObject *item = blk[k];
            if (!PyLong_Check(item)) {
                PyErr_SetString(PyExc_TypeError, "token_ids must hold ints");
                goto fail;
            }
            uint64_t t;
            if (!small_token(item, &t)) {
                t = (uint64_t)PyLong_AsUnsignedLongLongMask(item);
                if (t == (uint64_t)-1 && PyErr_Occurred()) goto fail;
            }
            x ^= t * K2;
            x = rotl64(x, 31) * K1;
        }
        h = fmix64(x ^ (uint64_t)bs);
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) goto fail;
        PyList_SET_ITEM(out, b, v);
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

/* The same hashes straight from the JSON text of a token array (the raw `token_ids` of a /route
 * body): no Python int is created per token. Returns (hashes, n_tokens), or None when the text is
 * not a plain array of non-negative JSON integers below 2**64 -- the caller then decodes it the
 * ordinary way, which also produces the error message. */
static inline const unsigned char *skip_ws(const unsigned char *p, const unsigned char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define CHASH_JSON_SWAR 1
#else
#define CHASH_JSON_SWAR 0
#endif

/* Block hashes of one JSON scan, kept as C integers until the whole text has parsed: no Python
 * object is made for a text that turns out not plain, and the list is created at its exact size. */
typedef struct {
    uint64_t *buf;
    Py_ssize_t len, cap;
    uint64_t stack[256];
} json_hashes;

static int json_hashes_grow(json_hashes *o) {
    size_t cap = (size_t)o->cap * 2;
    uint64_t *grown = o->buf == o->stack ? PyMem_Malloc(cap * sizeof(uint64_t))
                                         : PyMem_Realloc(o->buf, cap * sizeof(uint64_t));
    if (grown == NULL) return -1;
    if (o->buf == o->stack) memcpy(grown, o->stack, sizeof o->stack);
    o->buf = grown;
    o->cap = (Py_ssize_t)cap;
    return 0;
}

/* The scan behind chain_hashes_json: the token count, -1 when the text is not plain, -2 when out of
 * memory. sep_len (a constant at each call) is the separator the fast path expects: 2 for ", "
 * (json.dumps), 1 for ",". The fast path takes a number of 1..7 digits followed by exactly that
 * separator, 8 bytes at a time (SWAR); everything else -- the last number, other spacing, longer
 * numbers, the last 7 bytes -- goes through the byte-by-byte code, which alone decides what is
 * plain, so both accept exactly the same texts. */
static inline __attribute__((always_inline)) Py_ssize_t
json_hash_scan(const unsigned char *p, const unsigned char *end, Py_ssize_t bs, uint64_t parent,
               json_hashes *out, const int sep_len) {
    uint64_t h = parent, x = h ^ K3;
    Py_ssize_t left = bs; /* tokens still to come in the current block */
#define CHASH_JSON_TOKEN(v)                                                                   \
    do {                                                                                      \
        x ^= (v) * K2;                                                                        \
        x = rotl64(x, 31) * K1;                                                               \
        if (--left == 0) {                                                                    \
            h = fmix64(x ^ (uint64_t)bs);                                                     \
            if (out->len == out->cap && json_hashes_grow(out) < 0) return -2;                 \
            out->buf[out->len++] = h;                                                         \
            x = h ^ K3;                                                                       \
            left = bs;                                                                        \
        }                                                                                     \
    } while (0)
    p = skip_ws(p, end);
    if (p >= end || *p != '[') return -1;
    p = skip_ws(p + 1, end);
    if (p < end && *p == ']') { p++; goto closed; }
    for (;;) {
#if CHASH_JSON_SWAR
        const uint64_t sep_mask = sep_len == 2 ? 0xFFFF : 0xFF, sep = sep_len == 2 ? 0x202C : 0x2C;
        if (end - p >= 8) {
            const unsigned char *last = end - 8;
            while (p <= last) {
                uint64_t w;
                memcpy(&w, p, 8);
                /* The 8 bytes at p as one word. Only the lowest mark of each mask below is exact
                 * (a borrow or carry may mark later bytes wrongly), which is all that is used:
                 * m marks the first byte < '0' or >= 0xB0, gt the first byte > '9'. When gt has no
                 * mark at or below m's, the bytes before m's are digits and m's is < '0'. m is a
                 * short step from the load: the next position, which every token waits for,
                 * depends on it alone. */
                uint64_t t = w - 0x3030303030303030ULL; /* each leading digit byte becomes 0..9 */
                uint64_t m = t & 0x8080808080808080ULL;
                if (m == 0) break;
                unsigned bit = (unsigned)__builtin_ctzll(m); /* 8 * n_digits + 7 */
                uint64_t gt = ((w + 0x4646464646464646ULL) | w) & 0x8080808080808080ULL;
                /* 1..7 digits followed by exactly the separator; anything else goes the slow way */
                if (bit < 15 || (gt & (m ^ (m - 1))) != 0 || ((w >> (bit - 7)) & sep_mask) != sep) break;
                if ((t & 0xFF) == 0 && bit > 15) return -1; /* leading zero */
                uint64_t d = t << (71 - bit); /* the digits to the top bytes, the bytes after them out */
                d = (d * 10 + (d >> 8)) & 0x00FF00FF00FF00FFULL;
                d = (d * 100 + (d >> 16)) & 0x0000FFFF0000FFFFULL;
                d = (d * 10000 + (d >> 32)) & 0xFFFFFFFFULL;
                p += (bit >> 3) + sep_len;
                CHASH_JSON_TOKEN(d);
            }
        }
        /* after the fast path's ", " more whitespace may follow, as after any ',' */
        p = skip_ws(p, end);
#else
        (void)sep_len;
#endif
        if (p >= end || *p < '0' || *p > '9') return -1;
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') return -1;
        const unsigned char *digits = p;
        uint64_t v = 0;
        while (p < end && (unsigned)(*p - '0') < 10u) v = v * 10 + (uint64_t)(*p++ - '0');
        if (p - digits > 19) { /* 20 digits may overflow (more always do): check the slow way */
            if (p - digits > 20) return -1;
            v = 0;
            for (const unsigned char *q = digits; q < p; q++) {
                if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, (uint64_t)(*q - '0'), &v))
                    return -1;
            }
        }
        if (v > (uint64_t)INT64_MAX) return -1; /* not a token id: the list decode words the error */
        CHASH_JSON_TOKEN(v);
        p = skip_ws(p, end);
        if (p < end && *p == ',') { p = skip_ws(p + 1, end); continue; }
        if (p < end && *p == ']') { p++; break; }
        return -1;
    }
#undef CHASH_JSON_TOKEN
closed:
    p = skip_ws(p, end);
    if (p != end) return -1;
    return out->len * bs + (bs - left);
}

static PyObject *chain_hashes_json(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t bs;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "y*nK", &view, &bs, &parent)) return NULL;
    if (bs <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    const unsigned char *end = p + view.len;
    json_hashes hashes;
    hashes.buf = hashes.stack;
    hashes.len = 0;
    hashes.cap = (Py_ssize_t)(sizeof hashes.stack / sizeof hashes.stack[0]);
    /* the separator the fast path expects: whatever follows the first comma */
    const unsigned char *comma = view.len > 0 ? memchr(p, ',', (size_t)view.len) : NULL;
    Py_ssize_t n = comma != NULL && comma + 1 < end && comma[1] == ' '
                       ? json_hash_scan(p, end, bs, (uint64_t)parent, &hashes, 2)
                       : json_hash_scan(p, end, bs, (uint64_t)parent, &hashes, 1);
    PyObject *res = NULL;
    if (n == -2) {
        PyErr_NoMemory();
    } else if (n < 0) {
        Py_INCREF(Py_None);
        res = Py_None;
    } else {
        PyObject *out = PyList_New(hashes.len);
        if (out != NULL) {
            for (Py_ssize_t i = 0; i < hashes.len; i++) {
                PyObject *hv = PyLong_FromUnsignedLongLong(hashes.buf[i]);
                if (hv == NULL) { Py_CLEAR(out); break; }
                PyList_SET_ITEM(out, i, hv);
            }
        }
        if (out != NULL) res = Py_BuildValue("(Nn)", out, n);
    }
    if (hashes.buf != hashes.stack) PyMem_Free(hashes.buf);
    PyBuffer_Release(&view);
    return res;
}


/* ---- MaskMap: router hash -> slot mask (a Python int), the index's `present` table.
 * Open addressing over (uint64 key, mask) pairs: a lookup reads one slot, where a dict reads its
 * index array, its entry and the key's int object -- the /route walk is ~256 lookups into a table
 * of 10^5..10^6 blocks and is bound by those cache misses -- and no int object is kept per key.
 * Linear probing, backward-shift deletion, positions mixed with a per-table seed (keys come from
 * client-chosen tokens). Values are ints only, so the type needs no GC support. */

typedef struct {
    uint64_t key;
    PyObject *val; /* NULL: empty slot */
} MMSlot;

typedef struct {
    PyObject_HEAD
    Py_ssize_t used;
    size_t mask; /* capacity - 1; capacity is a power of two */
    MMSlot *slots;
    uint64_t seed;
} MaskMap;

static PyTypeObject MaskMapType;

static inline size_t mm_pos(const MaskMap *m, uint64_t key) {
    return (size_t)fmix64(key ^ m->seed) & m->mask;
}

static inline PyObject *mm_get(const MaskMap *m, uint64_t key) { /* borrowed, or NULL */
    size_t i = mm_pos(m, key);
    for (;;) {
        const MMSlot *s = &m->slots[i];
        if (s->val == NULL) return NULL;
        if (s->key == key) return s->val;
        i = (i + 1) & m->mask;
    }
}

static int mm_grow(MaskMap *m) {
    size_t oldcap = m->mask + 1, cap = oldcap * 2;
    MMSlot *old = m->slots;
    MMSlot *ns = PyMem_Calloc(cap, sizeof(MMSlot));
    if (ns == NULL) { PyErr_NoMemory(); return -1; }
    m->slots = ns;
    m->mask = cap - 1;
    for (size_t j = 0; j < oldcap; j++) {
        if (old[j].val == NULL) continue;
        size_t i = mm_pos(m, old[j].key);
        while (ns[i].val != NULL) i = (i + 1) & m->mask;
        ns[i] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

static int mm_set(MaskMap *m, uint64_t key, PyObject *val) { /* val is not stolen */
    size_t i = mm_pos(m, key);
    for (;;) {
        MMSlot *s = &m->slots[i];
        if (s->val == NULL) break;
        if (s->key == key) {
            Py_INCREF(val);
            Py_SETREF(s->val, val);
            return 0;
        }
        i = (i + 1) & m->mask;
    }
    if ((size_t)(m->used + 1) * 2 > m->mask + 1) { /* load <= 1/2: short probe runs */
        if (mm_grow(m) < 0) return -1;
        i = mm_pos(m, key);
        while (m->slots[i].val != NULL) i = (i + 1) & m->mask;
    }
    Py_INCREF(val);
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->used++;
    return 0;
}

static int mm_del(MaskMap *m, uint64_t key) { /* 1: deleted, 0: absent */
    size_t i = mm_pos(m, key);
    for (;;) {
        if (m->slots[i].val == NULL) return 0;
        if (m->slots[i].key == key) break;
        i = (i + 1) & m->mask;
    }
    PyObject *old = m->slots[i].val;
    size_t j = i;
    for (;;) { /* pull later entries of the run back over the hole */
        j = (j + 1) & m->mask;
        if (m->slots[j].val == NULL) break;
        size_t k = mm_pos(m, m->slots[j].key);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        m->slots[i] = m->slots[j];
        i = j;
    }
    m->slots[i].val = NULL;
    m->slots[i].key = 0;
    m->used--;
    Py_DECREF(old);
    return 1;
}

static int mm_key(PyObject *k, uint64_t *out) {
    if (!PyLong_Check(k)) {
        PyErr_Format(PyExc_TypeError, "MaskMap keys are ints, not %.100s", Py_TYPE(k)->tp_name);
        return -1;
    }
    uint64_t v = (uint64_t)PyLong_AsUnsignedLongLong(k);
    if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *MaskMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K", kwlist, &seed)) return NULL;
    MaskMap *m = (MaskMap *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->slots = PyMem_Calloc(8, sizeof(MMSlot));
    if (m->slots == NULL) { Py_DECREF(m); return PyErr_NoMemory(); }
    m->mask = 7;
    m->used = 0;
    m->seed = (uint64_t)seed;
    return (PyObject *)m;
}

static void mm_clear_all(MaskMap *m) {
    if (m->slots == NULL) return;
    for (size_t j = 0; j <= m->mask; j++) Py_CLEAR(m->slots[j].val);
    m->used = 0;
}

static void MaskMap_dealloc(MaskMap *m) {
    mm_clear_all(m);
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t MaskMap_len(MaskMap *m) { return m->used; }

static PyObject *MaskMap_subscript(MaskMap *m, PyObject *k) {
    uint64_t key;
    if (mm_key(k, &key) < 0) return NULL;
    PyObject *v = mm_get(m, key);
    if (v == NULL) { PyErr_SetObject(PyExc_KeyError, k); return NULL; }
    Py_INCREF(v);
    return v;
}

static int MaskMap_ass_subscript(MaskMap *m, PyObject *k, PyObject *v) {
    uint64_t key;
    if (mm_key(k, &key) < 0) return -1;
    if (v == NULL) {
        if (!mm_del(m, key)) { PyErr_SetObject(PyExc_KeyError, k); return -1; }
        return 0;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "MaskMap values are ints, not %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    return mm_set(m, key, v);
}

static int MaskMap_contains(MaskMap *m, PyObject *k) {
    uint64_t key;
    if (!PyLong_Check(k)) return 0;
    if (mm_key(k, &key) < 0) { PyErr_Clear(); return 0; }
    return mm_get(m, key) != NULL;
}

static PyObject *MaskMap_get(MaskMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    uint64_t key;
    PyObject *v = NULL;
    if (PyLong_Check(args[0])) {
        if (mm_key(args[0], &key) < 0) PyErr_Clear(); /* not a 64-bit hash: never stored */
        else v = mm_get(m, key);
    }
    if (v == NULL) v = dflt;
    Py_INCREF(v);
    return v;
}

static PyObject *MaskMap_pop(MaskMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t key;
    PyObject *v = NULL;
    if (PyLong_Check(args[0]) && mm_key(args[0], &key) == 0) v = mm_get(m, key);
    else PyErr_Clear();
    if (v == NULL) {
        if (nargs == 2) { Py_INCREF(args[1]); return args[1]; }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_INCREF(v);
    mm_del(m, key);
    return v;
}

/* A list of the keys, or of (key, mask) pairs. */
static PyObject *mm_list(MaskMap *m, int pairs) {
    PyObject *out = PyList_New(m->used);
    if (out == NULL) return NULL;
    Py_ssize_t n = 0;
    for (size_t j = 0; j <= m->mask && n < m->used; j++) {
        if (m->slots[j].val == NULL) continue;
        PyObject *item = PyLong_FromUnsignedLongLong(m->slots[j].key);
        if (item != NULL && pairs) {
            PyObject *k = item;
            item = PyTuple_Pack(2, k, m->slots[j].val);
            Py_DECREF(k);
        }
        if (item == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, n++, item);
    }
    return out;
}

static PyObject *MaskMap_items(MaskMap *m, PyObject *unused) { return mm_list(m, 1); }

static PyObject *MaskMap_keys(MaskMap *m, PyObject *unused) { return mm_list(m, 0); }

static PyObject *MaskMap_iter(MaskMap *m) {
    PyObject *keys = MaskMap_keys(m, NULL);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *MaskMap_clear(MaskMap *m, PyObject *unused) {
    mm_clear_all(m);
    Py_RETURN_NONE;
}

static PyObject *MaskMap_sizeof(MaskMap *m, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(MaskMap) + (m->mask + 1) * sizeof(MMSlot));
}

static PyMethodDef MaskMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))MaskMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))MaskMap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"items", (PyCFunction)MaskMap_items, METH_NOARGS, "a list of (key, mask) pairs"},
    {"keys", (PyCFunction)MaskMap_keys, METH_NOARGS, "a list of the keys"},
    {"clear", (PyCFunction)MaskMap_clear, METH_NOARGS, "remove every entry"},
    {"__sizeof__", (PyCFunction)MaskMap_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods MaskMap_as_mapping = {
    (lenfunc)MaskMap_len, (binaryfunc)MaskMap_subscript, (objobjargproc)MaskMap_ass_subscript,
};

static PySequenceMethods MaskMap_as_sequence = {
    .sq_contains = (objobjproc)MaskMap_contains,
};

static PyTypeObject MaskMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._chash.MaskMap",
    .tp_doc = "MaskMap(seed=0): uint64 router hash -> slot mask (int); a dict-like table",
    .tp_basicsize = sizeof(MaskMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = MaskMap_new,
    .tp_dealloc = (destructor)MaskMap_dealloc,
    .tp_as_mapping = &MaskMap_as_mapping,
    .tp_as_sequence = &MaskMap_as_sequence,
    .tp_iter = (getiterfunc)MaskMap_iter,
    .tp_methods = MaskMap_methods,
};

static MaskMap *as_maskmap(PyObject *o) {
    if (!PyObject_TypeCheck(o, &MaskMapType)) {
        PyErr_SetString(PyExc_TypeError, "present must be a MaskMap");
        return NULL;
    }
    return (MaskMap *)o;
}

/* ---- index hot paths: GPU stores and removals on a worker with no colliding router blocks.
 * Each stops at the first block that needs the general Python path and returns its index, so
 * Python stays the authority on every rare case. Same semantics as the Python fallbacks in
 * indexer/index/native.py (_py_store_gpu, _py_remove_gpu); the index tests run both. */

static inline uint64_t block_hash(uint64_t parent, PyObject **blk, Py_ssize_t bs, int *err) {
    uint64_t x = parent ^ K3;
    for (Py_ssize_t k = 0; k < bs; k++) {
        PyObject *item = blk[k];
        uint64_t t;
        if (!PyLong_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "token_ids must hold ints");
            *err = 1;
            return 0;
        }
        if (!small_token(item, &t)) {
            t = (uint64_t)PyLong_AsUnsignedLongLongMask(item);
            if (t == (uint64_t)-1 && PyErr_Occurred()) { *err = 1; return 0; }
        }
        x ^= t * K2;
        x = rotl64(x, 31) * K1;
    }
    return fmix64(x ^ (uint64_t)bs);
}

/* store_gpu(table, present, wbit, hashes, start, tokens, block_size, parent) -> stop index
 * tokens[0] is the first token of block ``start``. */
static PyObject *store_gpu(PyObject *self, PyObject *args) {
    PyObject *table, *present, *wbit, *hashes, *tokens;
    Py_ssize_t start, bs;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "O!OOO!nOnK", &PyDict_Type, &table, &present, &wbit,
                          &PyList_Type, &hashes, &start, &tokens, &bs, &parent))
        return NULL;
    MaskMap *pm = as_maskmap(present);
    if (pm == NULL) return NULL;
    if (bs <= 0) { PyErr_SetString(PyExc_ValueError, "block_size must be positive"); return NULL; }
    PyObject *fast = PySequence_Fast(tokens, "token_ids must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t ntok = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (start + ntok / bs < n) n = start + ntok / bs;
    uint64_t h = (uint64_t)parent;
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(hashes, i);
        int has = PyDict_Contains(table, e);
        if (has < 0) goto fail;
        if (has) break;
        int err = 0;
        h = block_hash(h, items + (i - start) * bs, bs, &err);
        if (err) goto fail;
        PyObject *hv = PyLong_FromUnsignedLongLong(h);
        if (hv == NULL) goto fail;
        PyObject *m = mm_get(pm, h); /* borrowed */
        PyObject *nm;
        if (m == NULL) {
            nm = wbit;
            Py_INCREF(nm);
        } else {
            PyObject *both = PyNumber_And(m, wbit);
            if (both == NULL) { Py_DECREF(hv); goto fail; }
            int collide = PyObject_IsTrue(both);
            Py_DECREF(both);
            if (collide) { Py_DECREF(hv); break; }
            nm = PyNumber_Or(m, wbit);
            if (nm == NULL) { Py_DECREF(hv); goto fail; }
        }
        if (PyDict_SetItem(table, e, hv) < 0 || mm_set(pm, h, nm) < 0) {
            Py_DECREF(hv); Py_DECREF(nm); goto fail;
        }
        Py_DECREF(hv);
        Py_DECREF(nm);
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(i);
fail:
    Py_DECREF(fast);
    return NULL;
}

/* remove_gpu(table, emask, present, keep, hashes, start) -> stop index */
static PyObject *remove_gpu(PyObject *self, PyObject *args) {
    PyObject *table, *emask, *present, *keep, *hashes;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!OOO!n", &PyDict_Type, &table, &PyDict_Type, &emask,
                          &present, &keep, &PyList_Type, &hashes, &start))
        return NULL;
    MaskMap *pm = as_maskmap(present);
    if (pm == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(hashes, i);
        PyObject *h = PyDict_GetItemWithError(table, e);
        if (h == NULL) { if (PyErr_Occurred()) return NULL; break; }
        int special = PyDict_Contains(emask, e);
        if (special < 0) return NULL;
        if (special) break;
        uint64_t hk;
        if (mm_key(h, &hk) < 0) return NULL;
        Py_INCREF(h);
        PyObject *m = mm_get(pm, hk);
        if (m == NULL) {
            Py_DECREF(h);
            break; /* inconsistent: let Python decide */
        }
        PyObject *nm = PyNumber_And(m, keep);
        if (nm == NULL) { Py_DECREF(h); return NULL; }
        int alive = PyObject_IsTrue(nm);
        int rc = alive ? mm_set(pm, hk, nm) : (mm_del(pm, hk), 0);
        Py_DECREF(nm);
        if (rc < 0 || PyDict_DelItem(table, e) < 0) { Py_DECREF(h); return NULL; }
        Py_DECREF(h);
    }
    return PyLong_FromSsize_t(i);
}


/* lengths[slot] = value for every set bit of mask (a non-negative int of at most nslots bits) */
static int spread_bits(PyObject *mask, PyObject *lengths, Py_ssize_t value) {
    Py_ssize_t nslots = PyList_GET_SIZE(lengths);
    Py_ssize_t nbytes = (nslots + 7) / 8;
    if (nbytes == 0) return 0;
    PyObject *b = PyObject_CallMethod(mask, "to_bytes", "ns", nbytes, "little");
    if (b == NULL) return -1;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(b);
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) { Py_DECREF(b); return -1; }
    for (Py_ssize_t k = 0; k < nbytes; k++) {
        unsigned char c = p[k];
        while (c) {
            int bit = __builtin_ctz(c);
            c &= (unsigned char)(c - 1);
            Py_ssize_t slot = k * 8 + bit;
            if (slot < nslots) {
                Py_INCREF(v);
                PyList_SetItem(lengths, slot, v); /* steals v, releases the old item */
            }
        }
    }
    Py_DECREF(v);
    Py_DECREF(b);
    return 0;
}

/* walk_lengths(present, hashes, alive, nslots) -> (lengths, end)
 * Looks each router hash up in ``present`` (hash -> slot mask), stopping at the first block no
 * slot holds or once no slot of ``alive`` is left (``end``), and returns each slot's matched
 * prefix length. Per block: one table lookup and one compare; bigint work only where the holder
 * set changes, which along a shared prefix is rare. */
#define WALK_AHEAD 16 /* lookups in flight: the table is far bigger than the caches */

/* mask as a machine word: 1, or 0 when it does not fit (the caller declines) */
static inline int as_word(PyObject *v, uint64_t *out) {
    uint64_t x = (uint64_t)PyLong_AsUnsignedLongLong(v);
    if (x == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    *out = x;
    return 1;
}

/* The walk for up to 64 slots: masks as machine words, and the table slot of the block
 * WALK_AHEAD ahead prefetched, so the ~256 cache misses of a walk overlap instead of queueing.
 * With `overlay` (router hash -> predicted slots, a dict) a predicted block counts as held, and
 * `pred` counts per slot the predicted blocks of its matched prefix that it does not hold.
 * Returns (lengths, end), or (lengths, preds) with an overlay; NULL with no error set when a
 * mask does not fit in a word (the caller takes the general walk). */
static PyObject *walk64(MaskMap *pm, PyObject *overlay, PyObject *hashes, uint64_t alive,
                        Py_ssize_t nslots) {
    Py_ssize_t n = PyList_GET_SIZE(hashes), i = 0;
    Py_ssize_t len[64], pred[64];
    uint64_t stack_keys[512];
    uint64_t *keys = n <= 512 ? stack_keys : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (keys == NULL) return PyErr_NoMemory();
    Py_ssize_t nkeys = 0;
    for (; nkeys < n; nkeys++) { /* a non-int or negative hash is never stored: stop there */
        PyObject *hk = PyList_GET_ITEM(hashes, nkeys);
        if (!PyLong_Check(hk)) break;
        uint64_t k = (uint64_t)PyLong_AsUnsignedLongLong(hk);
        if (k == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); break; }
        keys[nkeys] = k;
    }
    for (Py_ssize_t j = 0; j < WALK_AHEAD && j < nkeys; j++)
        __builtin_prefetch(&pm->slots[mm_pos(pm, keys[j])]);
    for (Py_ssize_t k = 0; k < nslots; k++) len[k] = pred[k] = 0;
    PyObject *prev = NULL, *result = NULL;
    uint64_t prevv = 0;
    for (; i < nkeys; i++) {
        if (i + WALK_AHEAD < nkeys) __builtin_prefetch(&pm->slots[mm_pos(pm, keys[i + WALK_AHEAD])]);
        PyObject *m = mm_get(pm, keys[i]);
        uint64_t mv = 0, ov = 0;
        if (m != NULL) {
            if (m != prev) {
                if (!as_word(m, &prevv)) goto done; /* declined */
                prev = m;
            }
            mv = prevv;
        }
        if (overlay != NULL) {
            PyObject *o = PyDict_GetItemWithError(overlay, PyList_GET_ITEM(hashes, i));
            if (o == NULL && PyErr_Occurred()) goto done;
            if (o != NULL && !as_word(o, &ov)) goto done; /* declined */
        }
        uint64_t held = mv | ov;
        if (!held) break;
        uint64_t dead = alive & ~held;
        if (dead) {
            for (; dead; dead &= dead - 1) len[__builtin_ctzll(dead)] = i;
            alive &= held;
            if (!alive) break;
        }
        for (uint64_t pr = ov & ~mv & alive; pr; pr &= pr - 1) pred[__builtin_ctzll(pr)]++;
    }
    for (; alive; alive &= alive - 1) len[__builtin_ctzll(alive)] = i;
    PyObject *lengths = PyList_New(nslots), *preds = overlay != NULL ? PyList_New(nslots) : NULL;
    if (lengths == NULL || (overlay != NULL && preds == NULL)) {
        Py_XDECREF(lengths);
        Py_XDECREF(preds);
        goto done;
    }
    for (Py_ssize_t k = 0; k < nslots; k++) {
        PyObject *v = PyLong_FromSsize_t(len[k]);
        PyObject *w = preds != NULL ? PyLong_FromSsize_t(pred[k]) : NULL;
        if (v == NULL || (preds != NULL && w == NULL)) {
            Py_XDECREF(v);
            Py_XDECREF(w);
            Py_DECREF(lengths);
            Py_XDECREF(preds);
            goto done;
        }
        PyList_SET_ITEM(lengths, k, v);
        if (preds != NULL) PyList_SET_ITEM(preds, k, w);
    }
    result = preds != NULL ? Py_BuildValue("(NN)", lengths, preds) : Py_BuildValue("(Nn)", lengths, i);
done:
    if (keys != stack_keys) PyMem_Free(keys);
    return result;
}

/* walk_overlay(present, overlay, hashes, alive, nslots) -> (lengths, predicted) | None
 * The walk with predictions (see walk64), for up to 64 slots; None where it declines. */
static PyObject *walk_overlay(PyObject *self, PyObject *args) {
    PyObject *present, *overlay, *hashes, *alive;
    Py_ssize_t nslots;
    if (!PyArg_ParseTuple(args, "OO!O!On", &present, &PyDict_Type, &overlay, &PyList_Type, &hashes,
                          &alive, &nslots))
        return NULL;
    MaskMap *pm = as_maskmap(present);
    if (pm == NULL) return NULL;
    uint64_t a;
    if (nslots <= 64 && PyLong_Check(alive) && as_word(alive, &a)) {
        PyObject *r = walk64(pm, overlay, hashes, a, nslots);
        if (r != NULL || PyErr_Occurred()) return r;
    }
    Py_RETURN_NONE;
}

static PyObject *walk_lengths(PyObject *self, PyObject *args) {
    PyObject *present, *hashes, *alive;
    Py_ssize_t nslots;
    if (!PyArg_ParseTuple(args, "OO!On", &present, &PyList_Type, &hashes, &alive, &nslots))
        return NULL;
    MaskMap *pm = as_maskmap(present);
    if (pm == NULL) return NULL;
    if (nslots <= 64 && PyLong_Check(alive)) {
        uint64_t a = (uint64_t)PyLong_AsUnsignedLongLong(alive);
        if (a == (uint64_t)-1 && PyErr_Occurred()) PyErr_Clear();
        else {
            PyObject *r = walk64(pm, NULL, hashes, a, nslots);
            if (r != NULL || PyErr_Occurred()) return r;
        }
    }
    PyObject *lengths = PyList_New(nslots);
    if (lengths == NULL) return NULL;
    PyObject *zero = PyLong_FromLong(0);
    for (Py_ssize_t k = 0; k < nslots; k++) { Py_INCREF(zero); PyList_SET_ITEM(lengths, k, zero); }
    Py_DECREF(zero);
    Py_INCREF(alive);
    PyObject *prev = NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes), i = 0;
    for (; i < n; i++) {
        PyObject *hk = PyList_GET_ITEM(hashes, i);
        uint64_t key;
        if (!PyLong_Check(hk)) break; /* never stored */
        key = (uint64_t)PyLong_AsUnsignedLongLong(hk);
        if (key == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); break; }
        PyObject *m = mm_get(pm, key);
        if (m == NULL) break;
        if (prev != NULL) {
            if (m == prev) continue;
            int same = PyObject_RichCompareBool(m, prev, Py_EQ);
            if (same < 0) goto fail;
            if (same) { prev = m; continue; }
        }
        PyObject *na = PyNumber_And(alive, m);
        if (na == NULL) goto fail;
        if (i > 0) {
            PyObject *inv = PyNumber_Invert(m);
            PyObject *dead = inv ? PyNumber_And(alive, inv) : NULL;
            Py_XDECREF(inv);
            if (dead == NULL || spread_bits(dead, lengths, i) < 0) {
                Py_XDECREF(dead); Py_DECREF(na); goto fail;
            }
            Py_DECREF(dead);
        }
        Py_DECREF(alive);
        alive = na;
        if (!PyObject_IsTrue(alive)) break;
        prev = m;
    }
    if (spread_bits(alive, lengths, i) < 0) goto fail;
    Py_DECREF(alive);
    return Py_BuildValue("(Nn)", lengths, i);
fail:
    Py_DECREF(alive);
    Py_DECREF(lengths);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_hashes", chain_hashes, METH_VARARGS,
     "chain_hashes(token_ids, block_size, parent) -> list of the chained 64-bit hash of each full block"},
    {"chain_hashes_json", chain_hashes_json, METH_VARARGS,
     "chain_hashes_json(json_array_bytes, block_size, parent) -> (hashes, n_tokens) or None"},
    {"store_gpu", store_gpu, METH_VARARGS,
     "store_gpu(table, present, wbit, hashes, start, tokens, block_size, parent) -> stop index"},
    {"remove_gpu", remove_gpu, METH_VARARGS,
     "remove_gpu(table, emask, present, keep, hashes, start) -> stop index"},
    {"walk_overlay", walk_overlay, METH_VARARGS,
     "walk_overlay(present, overlay, hashes, alive, nslots) -> (per-slot lengths, per-slot "
     "predicted blocks), or None past 64 slots"},
    {"walk_lengths", walk_lengths, METH_VARARGS,
     "walk_lengths(present, hashes, alive, nslots) -> (per-slot matched lengths, end)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chash(void) {
    if (PyType_Ready(&MaskMapType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    Py_INCREF(&MaskMapType);
    if (PyModule_AddObject(mod, "MaskMap", (PyObject *)&MaskMapType) < 0) {
        Py_DECREF(&MaskMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
