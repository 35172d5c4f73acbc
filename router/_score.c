/* C twin of router.scoring.rank for the /route and proxy hot paths: scores every candidate
 * (sets its ``credited`` and ``cost``) and returns the healthy ones' indices, best first.
 *
 * The Python function in router/scoring.py is the definition; this one does the same float
 * operations in the same order (tests hold the two to identical costs and orders) and declines
 * (returns None) on anything it does not model: a non-dict tier mapping, a missing worker hash,
 * NaN, counts past 64 bits. Python spends ~20 µs on 8 candidates, mostly per-attribute and
 * bigint work; here it is ~2 µs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    double cost, load;
    uint64_t tie;
    Py_ssize_t i;
} Entry;

static PyObject *s_by_tier, *s_predicted, *s_prefill, *s_shared_prefill, *s_active,
    *s_shared_active, *s_scraped, *s_healthy, *s_whash, *s_credited, *s_cost, *s_running,
    *s_waiting, *s_kv_usage;

static uint64_t tie_hash(uint64_t request_key, uint64_t whash) {
    uint64_t x = request_key ^ (whash * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    return x;
}

static int before(const Entry *a, const Entry *b) {
    if (a->cost != b->cost) return a->cost < b->cost;
    if (a->load != b->load) return a->load < b->load;
    if (a->tie != b->tie) return a->tie < b->tie;
    return a->i < b->i;
}

/* 1 and *out set; 0: declined (no error); -1: error */
static int get_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    if (PyFloat_CheckExact(v)) *out = PyFloat_AS_DOUBLE(v);
    else if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); Py_DECREF(v); return 0; }
        if (x > (1LL << 53) || x < -(1LL << 53)) { Py_DECREF(v); return 0; }
        *out = (double)x;
    } else { Py_DECREF(v); return 0; }
    Py_DECREF(v);
    return 1;
}

static int get_int(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    if (!PyLong_CheckExact(v)) { Py_DECREF(v); return 0; }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    if (x > (1LL << 53) || x < -(1LL << 53)) return 0;
    *out = x;
    return 1;
}

/* credit = float(predicted) + Σ weight(tier) · m over the non-zero counts, in dict order */
static int credit_of(PyObject *c, PyObject *tw, double ext, double *out) {
    long long pred;
    int r = get_int(c, s_predicted, &pred);
    if (r <= 0) return r;
    double credit = (double)pred;
    PyObject *bt = PyObject_GetAttr(c, s_by_tier);
    if (bt == NULL) return -1;
    if (!PyDict_CheckExact(bt)) { Py_DECREF(bt); return 0; }
    Py_ssize_t pos = 0;
    PyObject *tier, *m;
    while (PyDict_Next(bt, &pos, &tier, &m)) {
        if (!PyLong_CheckExact(m)) { Py_DECREF(bt); return 0; }
        int overflow;
        long long k = PyLong_AsLongLongAndOverflow(m, &overflow);
        if (overflow || k > (1LL << 53) || k < -(1LL << 53)) { Py_DECREF(bt); return 0; }
        if (k == 0) continue;
        PyObject *w = PyDict_GetItemWithError(tw, tier);
        double wv;
        if (w == NULL) {
            if (PyErr_Occurred()) { Py_DECREF(bt); return -1; }
            wv = ext;
        } else if (PyFloat_CheckExact(w)) wv = PyFloat_AS_DOUBLE(w);
        else { Py_DECREF(bt); return 0; }
        credit += wv * (double)k;
    }
    Py_DECREF(bt);
    *out = credit;
    return 1;
}

static int set_double(PyObject *obj, PyObject *name, double v) {
    PyObject *f = PyFloat_FromDouble(v);
    if (f == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, f);
    Py_DECREF(f);
    return r;
}

/* rank(candidates, n, overlap_weight, tier_weights, external_weight, running_weight,
 *      waiting_weight, kv_usage_weight, request_key) -> list[int] | None */
static PyObject *rank(PyObject *self, PyObject *args) {
    PyObject *cands, *tw, *rk_obj;
    Py_ssize_t n;
    double ow, ext, rw, ww, kw;
    if (!PyArg_ParseTuple(args, "O!ndO!ddddO!", &PyList_Type, &cands, &n, &ow, &PyDict_Type, &tw,
                          &ext, &rw, &ww, &kw, &PyLong_Type, &rk_obj))
        return NULL;
    uint64_t rk = (uint64_t)PyLong_AsUnsignedLongLong(rk_obj);
    if (rk == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
    Py_ssize_t count = PyList_GET_SIZE(cands);
    Entry stack[64];
    Entry *es = count <= 64 ? stack : PyMem_Malloc((size_t)count * sizeof(Entry));
    if (es == NULL) return PyErr_NoMemory();
    double *costs = PyMem_Malloc((size_t)(count ? count : 1) * 2 * sizeof(double));
    if (costs == NULL) { if (es != stack) PyMem_Free(es); return PyErr_NoMemory(); }
    Py_ssize_t m = 0;
    int r = 1;
    /* first everything is read and checked, so a decline leaves every candidate untouched */
    for (Py_ssize_t i = 0; i < count && r > 0; i++) {
        PyObject *c = PyList_GET_ITEM(cands, i);
        double credit, prefill, shared_prefill, cost;
        long long active, shared_active, whash;
        if ((r = credit_of(c, tw, ext, &credit)) <= 0) break;
        if ((r = get_double(c, s_prefill, &prefill)) <= 0) break;
        if ((r = get_double(c, s_shared_prefill, &shared_prefill)) <= 0) break;
        if ((r = get_int(c, s_active, &active)) <= 0) break;
        if ((r = get_int(c, s_shared_active, &shared_active)) <= 0) break;
        if ((r = get_int(c, s_whash, &whash)) <= 0) break;
        if (whash < 0) { r = 0; break; }
        double p = prefill - shared_prefill;
        if (p < 0.0) p = 0.0;
        long long a = active - shared_active;
        if (a < 0) a = 0;
        cost = ow * (p + (double)n - credit) + (double)a;
        PyObject *s = PyObject_GetAttr(c, s_scraped);
        if (s == NULL) { r = -1; break; }
        if (s != Py_None) {
            double run, wait, kv;
            if ((r = get_double(s, s_running, &run)) <= 0 || (r = get_double(s, s_waiting, &wait)) <= 0
                || (r = get_double(s, s_kv_usage, &kv)) <= 0) {
                Py_DECREF(s);
                break;
            }
            cost += rw * run + ww * wait + kw * kv;
        }
        Py_DECREF(s);
        if (isnan(cost)) { r = 0; break; }
        costs[2 * i] = credit;
        costs[2 * i + 1] = cost;
        PyObject *h = PyObject_GetAttr(c, s_healthy);
        if (h == NULL) { r = -1; break; }
        int healthy = PyObject_IsTrue(h);
        Py_DECREF(h);
        if (healthy < 0) { r = -1; break; }
        if (healthy) {
            Entry e = {cost, prefill + (double)active, tie_hash(rk, (uint64_t)whash), i};
            if (isnan(e.load)) { r = 0; break; }
            Py_ssize_t j = m++;
            while (j > 0 && before(&e, &es[j - 1])) { es[j] = es[j - 1]; j--; }
            es[j] = e;
        }
    }
    PyObject *out = NULL;
    if (r < 0) goto done;
    if (r == 0) { out = Py_None; Py_INCREF(out); goto done; }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *c = PyList_GET_ITEM(cands, i);
        if (set_double(c, s_credited, costs[2 * i]) < 0 || set_double(c, s_cost, costs[2 * i + 1]) < 0)
            goto done;
    }
    out = PyList_New(m);
    if (out == NULL) goto done;
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *v = PyLong_FromSsize_t(es[k].i);
        if (v == NULL) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, k, v);
    }
done:
    if (es != stack) PyMem_Free(es);
    PyMem_Free(costs);
    return out;
}

static PyMethodDef methods[] = {
    {"rank", rank, METH_VARARGS,
     "rank(candidates, n, overlap_weight, tier_weights, external_weight, running_weight, "
     "waiting_weight, kv_usage_weight, request_key) -> healthy indices best first, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_score", NULL, -1, methods};

PyMODINIT_FUNC PyInit__score(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_by_tier, "by_tier");
    INTERN(s_predicted, "predicted_blocks");
    INTERN(s_prefill, "inflight_prefill");
    INTERN(s_shared_prefill, "shared_prefill");
    INTERN(s_active, "active_blocks");
    INTERN(s_shared_active, "shared_active");
    INTERN(s_scraped, "scraped");
    INTERN(s_healthy, "healthy");
    INTERN(s_whash, "whash");
    INTERN(s_credited, "credited");
    INTERN(s_cost, "cost");
    INTERN(s_running, "running");
    INTERN(s_waiting, "waiting");
    INTERN(s_kv_usage, "kv_usage");
#undef INTERN
    return PyModule_Create(&module);
}
