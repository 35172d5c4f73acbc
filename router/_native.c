/* The router's own C helpers, kept because each pays for itself (measured on the 2-core dev
 * machine, busy): json_array_span lets a 4,096-token /route body be decoded and hashed in 29 us
 * instead of 63 (the token array is cut out and hashed in place); counts_add adds and removes
 * a request's 256 load-accounting keys in 21 us instead of 49; json_shape gives a decoded body's
 * top-level keys and nesting depth for the checks msgspec does not make (issue 21) in 1.3 us for
 * a 25 KB chat body, where its Python twin takes 59. Python twins: router.edge.bodies's whole-body decode,
 * router.placement.load._py_counts_add and router.edge.bodycheck.py_json_shape (tests hold them to the
 * same answers). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* counts_add(counts, keys, delta) -> None: counts[k] += delta for each key, dropping keys that
 * reach <= 0 (a dict of reference counts; the router's per-worker load accounting, where a
 * proxied request adds and later removes each of its ~10^2 blocks twice). */
static PyObject *counts_add(PyObject *self, PyObject *args) {
    PyObject *d, *keys;
    long delta;
    if (!PyArg_ParseTuple(args, "O!Ol", &PyDict_Type, &d, &keys, &delta)) return NULL;
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        PyObject *old = PyDict_GetItemWithError(d, k); /* borrowed */
        long v = 0;
        if (old != NULL) {
            v = PyLong_AsLong(old);
            if (v == -1 && PyErr_Occurred()) goto fail;
        } else if (PyErr_Occurred()) {
            goto fail;
        }
        v += delta;
        int rc;
        if (v > 0) {
            PyObject *nv = PyLong_FromLong(v);
            if (nv == NULL) goto fail;
            rc = PyDict_SetItem(d, k, nv);
            Py_DECREF(nv);
        } else {
            rc = old != NULL ? PyDict_DelItem(d, k) : 0;
        }
        if (rc < 0) goto fail;
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    return NULL;
}

/* ---- /route body: where the token array sits, so it is hashed once, in place. */

static inline const unsigned char *ws_skip(const unsigned char *p, const unsigned char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* p at an opening quote: the byte after the closing one, or NULL. */
static const unsigned char *str_skip(const unsigned char *p, const unsigned char *end) {
    const unsigned char *from = p + 1;
    for (;;) {
        const unsigned char *q = memchr(from, '"', (size_t)(end - from));
        if (q == NULL) return NULL;
        const unsigned char *r = q;
        while (r > from && r[-1] == '\\') r--;
        if (((q - r) & 1) == 0) return q + 1; /* an even run of backslashes escapes nothing */
        from = q + 1;
    }
}

/* Skip one JSON value (not validated: the caller's decoder does that); when maxd is not NULL,
 * raise *maxd to how deep the value nests arrays and objects (a scalar: 0). */
static const unsigned char *value_skip(const unsigned char *p, const unsigned char *end,
                                       Py_ssize_t *maxd) {
    if (p >= end) return NULL;
    if (*p == '"') return str_skip(p, end);
    if (*p == '[' || *p == '{') {
        Py_ssize_t depth = 0;
        while (p < end) {
            unsigned char c = *p;
            if (c == '"') {
                p = str_skip(p, end);
                if (p == NULL) return NULL;
                continue;
            }
            if (c == '[' || c == '{') {
                depth++;
                if (maxd != NULL && depth > *maxd) *maxd = depth;
            } else if (c == ']' || c == '}') {
                if (--depth == 0) return p + 1;
            }
            p++;
        }
        return NULL;
    }
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' &&
           *p != '\n' && *p != '\r')
        p++;
    return p;
}

/* json_array_span(body, key) -> (start, end) | None: body[start:end] is the value of the first
 * top-level member `key` of the JSON object `body` when that value is a flat array (no nested
 * array, object or string in it; its elements are not checked). None otherwise -- not an object,
 * no such key, another kind of value -- and the caller decodes the whole body the ordinary way. */
static PyObject *json_array_span(PyObject *self, PyObject *args) {
    Py_buffer view, key;
    if (!PyArg_ParseTuple(args, "y*y*", &view, &key)) return NULL;
    const unsigned char *start = (const unsigned char *)view.buf;
    const unsigned char *end = start + view.len;
    const unsigned char *p = ws_skip(start, end);
    Py_ssize_t a = -1, b = -1;
    if (p >= end || *p != '{') goto done;
    p++;
    for (;;) {
        p = ws_skip(p, end);
        if (p >= end || *p != '"') goto done;
        const unsigned char *k = p + 1;
        p = str_skip(p, end);
        if (p == NULL) goto done;
        Py_ssize_t klen = (p - 1) - k;
        p = ws_skip(p, end);
        if (p >= end || *p != ':') goto done;
        p = ws_skip(p + 1, end);
        if (klen == key.len && memcmp(k, key.buf, (size_t)klen) == 0) {
            if (p < end && *p == '[') {
                const unsigned char *q = memchr(p, ']', (size_t)(end - p));
                size_t inner = q != NULL ? (size_t)(q - p - 1) : 0;
                if (q != NULL && memchr(p + 1, '[', inner) == NULL &&
                    memchr(p + 1, '{', inner) == NULL && memchr(p + 1, '"', inner) == NULL) {
                    a = p - start;
                    b = q + 1 - start;
                }
            }
            goto done;
        }
        p = value_skip(p, end, NULL);
        if (p == NULL) goto done;
        p = ws_skip(p, end);
        if (p >= end || *p != ',') goto done;
        p++;
    }
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&key);
    if (a < 0) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", a, b);
}

/* json_shape(body) -> (keys, depth, escaped) | None: the top-level keys of the JSON object
 * `body`, in order, as written (escapes and all), how deep it nests arrays and objects (the
 * object itself is 1), and whether any key holds a backslash. Not validated: for a body the
 * caller's decoder has accepted. None when `body` is not an object or the scan falls off its
 * end. */
static PyObject *json_shape(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    const unsigned char *start = (const unsigned char *)view.buf;
    const unsigned char *end = start + view.len;
    const unsigned char *p = ws_skip(start, end);
    PyObject *keys = NULL, *out = NULL;
    Py_ssize_t maxd = 0;
    int escaped = 0;
    if (p >= end || *p != '{') goto none;
    keys = PyList_New(0);
    if (keys == NULL) goto done;
    p = ws_skip(p + 1, end);
    if (p < end && *p == '}') goto shaped;
    for (;;) {
        p = ws_skip(p, end);
        if (p >= end || *p != '"') goto none;
        const unsigned char *k = p + 1;
        p = str_skip(p, end);
        if (p == NULL) goto none;
        if (!escaped && memchr(k, '\\', (size_t)((p - 1) - k)) != NULL) escaped = 1;
        PyObject *key = PyBytes_FromStringAndSize((const char *)k, (p - 1) - k);
        if (key == NULL) goto done;
        int rc = PyList_Append(keys, key);
        Py_DECREF(key);
        if (rc < 0) goto done;
        p = ws_skip(p, end);
        if (p >= end || *p != ':') goto none;
        p = value_skip(ws_skip(p + 1, end), end, &maxd);
        if (p == NULL) goto none;
        p = ws_skip(p, end);
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') break;
        goto none;
    }
shaped:
    out = Py_BuildValue("(OnO)", keys, maxd + 1, escaped ? Py_True : Py_False);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"counts_add", counts_add, METH_VARARGS,
     "counts_add(counts, keys, delta): counts[k] += delta, dropping keys that reach <= 0"},
    {"json_array_span", json_array_span, METH_VARARGS,
     "json_array_span(json_object_bytes, key) -> (start, end) of the top-level key's array, or None"},
    {"json_shape", json_shape, METH_VARARGS,
     "json_shape(json_object_bytes) -> (top-level keys, nesting depth, escaped keys), or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
