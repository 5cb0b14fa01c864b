/* The one-pass kernel (stats_kernel.c) as a CPython extension module, and the CSV row
 * formatter of the writer.
 *
 * Why an extension beside the ctypes library: for the small tensors of a deep model the
 * fixed cost of a call dominates. A ctypes call (argument conversion, result objects,
 * GIL hand-over) costs about 1.9 us; a METH_FASTCALL function about 0.1 us. And the
 * writer's rows cost about 1.3 us each in Python (one str.format and one f-string per
 * row); here they are formatted with PyOS_double_to_string, the routine behind Python's
 * own format(x, ".9g"), so every cell is byte for byte what the Python writer gives.
 *
 * Built at run time by native/__init__.py where the Python headers are installed; where
 * they are not, the ctypes library of stats_kernel.c alone is used, and the writer
 * formats in Python. Nothing here knows a framework. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdlib.h>
#include <time.h>

#include "stats_kernel.c"

#if PY_VERSION_HEX < 0x030A0000 /* Py_NewRef is 3.10's */
static inline PyObject *Py_NewRef(PyObject *obj) {
    Py_INCREF(obj);
    return obj;
}
#endif

/* Above this many elements the GIL is released for the reduction, as ctypes does for
   every call (a small tensor's reduction is shorter than the hand-over). */
#define RELEASE_GIL_ABOVE ((int64_t)1 << 16)

static int64_t run_stats(const void *data, int64_t n, int dtype, int threads, double *out, int64_t *zeros) {
    int64_t nans;
    if (n > RELEASE_GIL_ABOVE) {
        Py_BEGIN_ALLOW_THREADS
        nans = stats(data, n, dtype, threads, out, zeros);
        Py_END_ALLOW_THREADS
    } else {
        nans = stats(data, n, dtype, threads, out, zeros);
    }
    return nans;
}

/* Four doubles as a new list or tuple of floats. */
static PyObject *four_floats(const double *values, int as_tuple) {
    PyObject *v = as_tuple ? PyTuple_New(4) : PyList_New(4);
    if (v == NULL)
        return NULL;
    for (int i = 0; i < 4; i++) {
        PyObject *f = PyFloat_FromDouble(values[i]);
        if (f == NULL) {
            Py_DECREF(v);
            return NULL;
        }
        if (as_tuple)
            PyTuple_SET_ITEM(v, i, f);
        else
            PyList_SET_ITEM(v, i, f);
    }
    return v;
}

/* [min, max, sum, norm] as the ctypes binding gives it: min and max NaN when there is a
   NaN, the norm the square root of the sum of squares. */
static PyObject *vector_object(const double *out, int64_t nans, int as_tuple) {
    double mn = out[0], mx = out[1];
    if (nans)
        mn = mx = Py_NAN;
    double values[4] = {mn, mx, out[2], sqrt(out[3])};
    return four_floats(values, as_tuple);
}

static int parse_buffer(PyObject *const *args, const void **data, int64_t *n, int *dtype, int *threads) {
    *data = PyLong_AsVoidPtr(args[0]);
    if (*data == NULL && PyErr_Occurred())
        return -1;
    *n = PyLong_AsLongLong(args[1]);
    if (*n == -1 && PyErr_Occurred())
        return -1;
    *dtype = (int)PyLong_AsLong(args[2]);
    if (*dtype == -1 && PyErr_Occurred())
        return -1;
    *threads = args[3] == NULL ? 1 : (int)PyLong_AsLong(args[3]);
    if (*threads == -1 && PyErr_Occurred())
        return -1;
    if (*n <= 0 || *data == NULL || *dtype < F32 || *dtype > F16 || !(msprobe_stats_dtypes() & (1 << *dtype))) {
        PyErr_SetString(PyExc_ValueError, "stats: a non-empty buffer of a known dtype code is required");
        return -1;
    }
    return 0;
}

/* stats / stats_zeros: one buffer; with `with_zeros` the zero count too. */
static PyObject *one_buffer(PyObject *const *args, Py_ssize_t nargs, int with_zeros) {
    const void *data;
    int64_t n, zeros = 0;
    int dtype, threads;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stats takes 3 or 4 arguments");
        return NULL;
    }
    PyObject *given[4] = {args[0], args[1], args[2], nargs == 4 ? args[3] : NULL};
    if (parse_buffer(given, &data, &n, &dtype, &threads) < 0)
        return NULL;
    double out[4];
    int64_t nans = run_stats(data, n, dtype, threads, out, with_zeros ? &zeros : NULL);
    PyObject *v = vector_object(out, nans, 0);
    if (v == NULL)
        return NULL;
    if (with_zeros)
        return Py_BuildValue("(NLL)", v, (long long)nans, (long long)zeros);
    return Py_BuildValue("(NL)", v, (long long)nans);
}

/* stats(pointer, count, dtype_code[, threads=1]) -> ([min, max, sum, norm], nans) */
static PyObject *py_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return one_buffer(args, nargs, 0);
}

/* stats_zeros(pointer, count, dtype_code[, threads=1]) -> ([min, max, sum, norm], nans, zeros) */
static PyObject *py_stats_zeros(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return one_buffer(args, nargs, 1);
}

/* The pointer, count and dtype-code sequences of a call over many buffers (stats_many,
   records_many): opened and checked once, read buffer by buffer. */
typedef struct {
    PyObject *ptrs, *counts, *codes;
    Py_ssize_t n;
} batch_t;

static void batch_close(batch_t *b) {
    Py_XDECREF(b->ptrs);
    Py_XDECREF(b->counts);
    Py_XDECREF(b->codes);
}

/* 0, or -1 with an exception set (the batch is closed either way by batch_close). */
static int batch_open(batch_t *b, PyObject *ptrs, PyObject *counts, PyObject *codes, Py_ssize_t n_keys,
                      const char *fn) {
    b->ptrs = PySequence_Fast(ptrs, "pointers must be a sequence");
    b->counts = b->ptrs ? PySequence_Fast(counts, "counts must be a sequence") : NULL;
    b->codes = b->counts ? PySequence_Fast(codes, "dtype codes must be a sequence") : NULL;
    if (b->codes == NULL)
        return -1;
    b->n = PySequence_Fast_GET_SIZE(b->ptrs);
    if (PySequence_Fast_GET_SIZE(b->counts) != b->n || PySequence_Fast_GET_SIZE(b->codes) != b->n ||
        (n_keys >= 0 && n_keys != b->n)) {
        PyErr_Format(PyExc_ValueError, "%s: the sequences differ in length", fn);
        return -1;
    }
    return 0;
}

/* Buffer i's statistics into out (and *zeros unless NULL): its NaN count, or -1 with an
   exception set. */
static int64_t batch_read(batch_t *b, Py_ssize_t i, int threads, double *out, int64_t *zeros) {
    PyObject *item_args[4] = {PySequence_Fast_GET_ITEM(b->ptrs, i), PySequence_Fast_GET_ITEM(b->counts, i),
                              PySequence_Fast_GET_ITEM(b->codes, i), NULL};
    const void *data;
    int64_t n;
    int dtype, unused;
    if (parse_buffer(item_args, &data, &n, &dtype, &unused) < 0)
        return -1;
    return run_stats(data, n, dtype, threads, out, zeros);
}

/* stats_many(pointers, counts, dtype_codes, threads, zeros) ->
   ([(min, max, sum, norm), ...], [nans, ...], [zeros, ...] or None) */
static PyObject *py_stats_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "stats_many takes 5 arguments");
        return NULL;
    }
    batch_t batch = {NULL, NULL, NULL, 0};
    PyObject *vectors = NULL, *nan_list = NULL, *zero_list = NULL, *result = NULL;
    int threads = (int)PyLong_AsLong(args[3]);
    int want_zeros = PyObject_IsTrue(args[4]);
    if ((threads == -1 && PyErr_Occurred()) || want_zeros < 0 ||
        batch_open(&batch, args[0], args[1], args[2], -1, "stats_many") < 0)
        goto done;
    Py_ssize_t m = batch.n;
    vectors = PyList_New(m);
    nan_list = PyList_New(m);
    zero_list = want_zeros ? PyList_New(m) : NULL;
    if (vectors == NULL || nan_list == NULL || (want_zeros && zero_list == NULL))
        goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        double out[4];
        int64_t zeros = 0;
        int64_t nans = batch_read(&batch, i, threads, out, want_zeros ? &zeros : NULL);
        if (nans < 0)
            goto done;
        PyObject *v = vector_object(out, nans, 1);
        PyObject *nn = v ? PyLong_FromLongLong(nans) : NULL;
        if (nn == NULL) {
            Py_XDECREF(v);
            goto done;
        }
        PyList_SET_ITEM(vectors, i, v);
        PyList_SET_ITEM(nan_list, i, nn);
        if (want_zeros) {
            PyObject *z = PyLong_FromLongLong(zeros);
            if (z == NULL)
                goto done;
            PyList_SET_ITEM(zero_list, i, z);
        }
    }
    result = PyTuple_Pack(3, vectors, nan_list, want_zeros ? zero_list : Py_None);
done:
    batch_close(&batch);
    Py_XDECREF(vectors);
    Py_XDECREF(nan_list);
    Py_XDECREF(zero_list);
    return result;
}

/* ------------------------------------------------------------------ rows */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} buffer_t;

static int reserve(buffer_t *b, Py_ssize_t more) {
    if (b->len + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *grown = PyMem_Realloc(b->data, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = grown;
    b->cap = cap;
    return 0;
}

static int append(buffer_t *b, const char *s, Py_ssize_t n) {
    if (reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static int append_char(buffer_t *b, char c) {
    if (reserve(b, 1) < 0)
        return -1;
    b->data[b->len++] = c;
    return 0;
}

/* The cell of a text (module name, scope) as the Python writer writes it: looked up in
   `cells`, computed by `cell_fn` on first use and kept there. Its UTF-8 bytes, which
   live as long as `cells` holds the cell, and their length in *n; NULL on an error. */
static const char *cell_of(PyObject *text, PyObject *cells, PyObject *cell_fn, Py_ssize_t *n) {
    PyObject *cell = PyDict_GetItemWithError(cells, text); /* borrowed */
    if (cell == NULL) {
        if (PyErr_Occurred())
            return NULL;
        cell = PyObject_CallOneArg(cell_fn, text);
        if (cell == NULL)
            return NULL;
        int failed = PyDict_SetItem(cells, text, cell);
        Py_DECREF(cell); /* the dict holds it */
        if (failed < 0)
            return NULL;
    }
    if (!PyUnicode_Check(cell)) {
        PyErr_SetString(PyExc_TypeError, "format_rows: a cell is not a str");
        return NULL;
    }
    return PyUnicode_AsUTF8AndSize(cell, n);
}

static int append_cell(buffer_t *b, PyObject *text, PyObject *cells, PyObject *cell_fn) {
    Py_ssize_t n;
    const char *utf8 = cell_of(text, cells, cell_fn, &n);
    return utf8 == NULL ? -1 : append(b, utf8, n);
}

/* An int cell: str(value) of a Python int. */
static int append_int(buffer_t *b, PyObject *value) {
    if (!PyLong_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "format_rows: a count is not an int");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    char s[24];
    int n = sizeof s;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do { /* snprintf's parsing costs more than the digits */
        s[--n] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        s[--n] = '-';
    return append(b, s + n, (Py_ssize_t)sizeof s - n);
}

/* Nine significant digits, fast: the digits of |value| x 10^(8 - exponent) rounded to an
   integer. The power of ten and the product are each rounded once (double precision), so
   the product's relative error is below 2^-52 (2.3e-16) and its absolute error on a number
   below 10^9 is below 2.3e-7. Where the fraction is within 1e-6 of one half (a tie, or too
   close to tell) or the power of ten is out of double's range, -1 is returned and the
   caller asks PyOS_double_to_string, the routine behind format(value, ".9g"), which also
   decides every other case exactly: this path only takes the cases whose rounding it can
   prove. 0 on success. */
#define POW10_MIN (-307)
#define POW10_MAX 308
static double pow10_table[POW10_MAX - POW10_MIN + 1];

static void pow10_init(void) {
    char text[16];
    for (int k = POW10_MIN; k <= POW10_MAX; k++) {
        snprintf(text, sizeof text, "1e%d", k);
        pow10_table[k - POW10_MIN] = strtod(text, NULL); /* correctly rounded */
    }
}

static int nine_digits(double a, uint64_t *digits, int *exponent) {
    /* the decimal exponent from the binary one (log10(2) = 0.30103...): exact or one too
       small, which the first attempt below corrects (cheaper than log10). The binary
       exponent is read from the bits (frexp's, for a normal double); a subnormal one
       asks frexp. */
    uint64_t bits;
    memcpy(&bits, &a, sizeof bits);
    int b = (int)((bits >> 52) & 0x7ff) - 1022;
    if (b == -1022)
        frexp(a, &b);
    int e = ((b - 1) * 78913) >> 18; /* floor((b - 1) log10(2)) for |b| < 2^11, without libm */
    for (int attempt = 0; attempt < 3; attempt++) {
        int k = 8 - e;
        if (k < POW10_MIN || k > POW10_MAX)
            return -1;
        double scaled = a * pow10_table[k - POW10_MIN];
        if (scaled >= 1e9) {
            e++;
            continue;
        }
        if (scaled < 1e8) {
            e--;
            continue;
        }
        int64_t d = (int64_t)scaled; /* floor: scaled is positive */
        double frac = scaled - (double)d; /* exact: scaled < 2^30 */
        if (fabs(frac - 0.5) < 1e-6)
            return -1;
        d += frac > 0.5;
        if (d == 1000000000) {
            d = 100000000;
            e++;
        }
        *digits = (uint64_t)d;
        *exponent = e;
        return 0;
    }
    return -1;
}

/* "00" "01" ... "99": two digits at a time */
static const char digit_pairs[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* format(value, ".9g") from its digits: fixed notation for exponents -4..8, else
   d.ddde+XX (at least two exponent digits), trailing zeros and a bare point left out.
   The digits are made two at a time and copied in blocks of fixed size (the buffer has
   room past the cell; what lies past it is overwritten by the next cell or never used). */
static int append_g9(buffer_t *b, int negative, uint64_t digits, int e) {
    if (reserve(b, 40) < 0) /* the longest cell (-0.0000ddddddddd, -d.ddddddddde-XXX) is 16 bytes */
        return -1;
    char d[24];
    uint32_t v = (uint32_t)digits; /* 10^8 <= v < 10^9 */
    uint32_t first = v / 100000000u, rest = v - first * 100000000u;
    uint32_t upper = rest / 10000u, lower = rest - upper * 10000u;
    d[0] = (char)('0' + first);
    memcpy(d + 1, digit_pairs + 2 * (upper / 100u), 2);
    memcpy(d + 3, digit_pairs + 2 * (upper % 100u), 2);
    memcpy(d + 5, digit_pairs + 2 * (lower / 100u), 2);
    memcpy(d + 7, digit_pairs + 2 * (lower % 100u), 2);
    memcpy(d + 9, "000000000000000", 15); /* read by the fixed-size copies below */
    int k = 9;
    while (k > 1 && d[k - 1] == '0')
        k--;
    char *out = b->data + b->len; /* written in place: no copy of a cell */
    int n = 0;
    if (negative)
        out[n++] = '-';
    if (e >= 0 && e < 9) {
        memcpy(out + n, d, 9); /* the digits before the point, and '0' where they ran out */
        n += e + 1;
        if (k > e + 1) {
            out[n++] = '.';
            memcpy(out + n, d + e + 1, 8);
            n += k - e - 1;
        }
    } else if (e < 0 && e >= -4) {
        memcpy(out + n, "0.000", 5);
        n += 1 - e; /* "0." and -e - 1 zeros */
        memcpy(out + n, d, 9);
        n += k;
    } else {
        out[n++] = d[0];
        if (k > 1) {
            out[n++] = '.';
            memcpy(out + n, d + 1, 8);
            n += k - 1;
        }
        int x = e < 0 ? -e : e; /* at least two digits, as printf's %02d */
        out[n++] = 'e';
        out[n++] = e < 0 ? '-' : '+';
        if (x >= 100) {
            out[n++] = (char)('0' + x / 100);
            x %= 100;
        }
        memcpy(out + n, digit_pairs + 2 * x, 2);
        n += 2;
    }
    b->len += n;
    return 0;
}

/* format(value, ".9g"): nan (of either sign), inf and -inf as Python writes them. */
static int append_float(buffer_t *b, double value) {
    if (isnan(value))
        return append(b, "nan", 3);
    if (isinf(value))
        return value > 0 ? append(b, "inf", 3) : append(b, "-inf", 4);
    if (value == 0.0)
        return signbit(value) ? append(b, "-0", 2) : append(b, "0", 1);
    uint64_t digits;
    int e;
    if (nine_digits(fabs(value), &digits, &e) == 0)
        return append_g9(b, value < 0, digits, e);
    char *s = PyOS_double_to_string(value, 'g', 9, 0, NULL);
    if (s == NULL)
        return -1;
    int failed = append(b, s, (Py_ssize_t)strlen(s));
    PyMem_Free(s);
    return failed;
}

/* _format_float(value) -> str: one cell as format_rows writes it (for the tests). */
static PyObject *py_format_float(PyObject *self, PyObject *value) {
    double v = PyFloat_AsDouble(value);
    if (v == -1.0 && PyErr_Occurred())
        return NULL;
    buffer_t b = {NULL, 0, 0};
    if (append_float(&b, v) < 0) {
        PyMem_Free(b.data);
        return NULL;
    }
    PyObject *out = PyUnicode_FromStringAndSize(b.data, b.len);
    PyMem_Free(b.data);
    return out;
}

static int float_item(PyObject *row, Py_ssize_t i, double *out) {
    PyObject *item = PyTuple_GET_ITEM(row, i);
    if (!PyFloat_CheckExact(item)) {
        PyErr_SetString(PyExc_TypeError, "format_rows: a statistic is not a float");
        return -1;
    }
    *out = PyFloat_AS_DOUBLE(item);
    return 0;
}

enum { OP_MIN, OP_MAX, OP_MEAN, OP_NORM, OP_NANS, OP_ZEROS };

/* The columns every row of one file shares: the step's text, the statistic columns
   (one OP_* each), whether a micro_step column is written, and the cell cache. */
typedef struct {
    const char *step_text;
    Py_ssize_t step_len;
    const char *op;
    Py_ssize_t n_ops;
    int with_micro;
    PyObject *cells, *cell_fn;
    /* the last scope's cell (rows of one monitor share a few scopes: no lookup per row);
       borrowed, while the rows and the cells dict hold them */
    PyObject *scope;
    const char *scope_cell;
    Py_ssize_t scope_len;
} row_format_t;

/* Parse (step_text, op_codes, with_micro_step, cells, cell_fn) of format_rows and
   format_records. */
static int row_format_parse(PyObject *const *args, row_format_t *f) {
    PyObject *step = args[0], *ops = args[1];
    f->with_micro = PyObject_IsTrue(args[2]);
    if (f->with_micro < 0)
        return -1;
    f->cells = args[3];
    f->cell_fn = args[4];
    if (!PyUnicode_Check(step) || !PyBytes_Check(ops) || !PyDict_Check(f->cells)) {
        PyErr_SetString(PyExc_TypeError, "format_rows: (list, str, bytes, bool, dict, callable) expected");
        return -1;
    }
    f->step_text = PyUnicode_AsUTF8AndSize(step, &f->step_len);
    if (f->step_text == NULL)
        return -1;
    f->op = PyBytes_AS_STRING(ops);
    f->n_ops = PyBytes_GET_SIZE(ops);
    f->scope = NULL;
    f->scope_cell = NULL;
    f->scope_len = 0;
    return 0;
}

/* One row "vpp,step,name,scope,[micro,]<stats>\n", exactly as the writer's Python
   formatter writes it. */
static int format_one(buffer_t *b, row_format_t *f, PyObject *vpp, PyObject *name, PyObject *scope,
                      PyObject *micro, long long numel, double mn, double mx, double total, double sumsq,
                      PyObject *nans, PyObject *zeros) {
    if (append_int(b, vpp) < 0 || append_char(b, ',') < 0 || append(b, f->step_text, f->step_len) < 0 ||
        append_char(b, ',') < 0 || append_cell(b, name, f->cells, f->cell_fn) < 0 || append_char(b, ',') < 0)
        return -1;
    if (scope != f->scope) {
        f->scope = NULL;
        f->scope_cell = cell_of(scope, f->cells, f->cell_fn, &f->scope_len);
        if (f->scope_cell == NULL)
            return -1;
        f->scope = scope;
    }
    if (append(b, f->scope_cell, f->scope_len) < 0 || append_char(b, ',') < 0)
        return -1;
    if (f->with_micro && ((micro != Py_None && append_int(b, micro) < 0) || append_char(b, ',') < 0))
        return -1;
    for (Py_ssize_t k = 0; k < f->n_ops; k++) {
        if (k && append_char(b, ',') < 0)
            return -1;
        int failed;
        switch (f->op[k]) {
        case OP_MIN: failed = append_float(b, numel ? mn : Py_NAN); break;
        case OP_MAX: failed = append_float(b, numel ? mx : Py_NAN); break;
        case OP_MEAN: failed = append_float(b, numel ? total / (double)numel : Py_NAN); break;
        case OP_NORM:
            if (sumsq < 0) { /* math.sqrt raises here: let Python say so */
                PyErr_SetString(PyExc_ValueError, "format_rows: a negative sum of squares");
                return -1;
            }
            failed = append_float(b, sqrt(sumsq));
            break;
        case OP_NANS: failed = append_int(b, nans); break;
        case OP_ZEROS: failed = append_int(b, zeros); break;
        default:
            PyErr_SetString(PyExc_ValueError, "format_rows: unknown op code");
            return -1;
        }
        if (failed < 0)
            return -1;
    }
    return append_char(b, '\n');
}

static PyObject *buffer_bytes(buffer_t *b) {
    PyObject *result = PyBytes_FromStringAndSize(b->data ? b->data : "", b->len);
    PyMem_Free(b->data);
    return result;
}

/* format_rows(rows, step_text, op_codes, with_micro_step, cells, cell_fn) -> bytes

   rows: a list of tuples (vpp_stage, name, scope, micro_step, numel, min, max, total,
   sumsq, nans, zeros), as stats.merge_fields gives them; op_codes: bytes, one OP_* per
   statistic column. A row of another shape or types raises TypeError (the caller then
   formats in Python). */
static PyObject *py_format_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "format_rows takes 6 arguments");
        return NULL;
    }
    PyObject *rows = args[0];
    row_format_t f;
    if (row_format_parse(args + 1, &f) < 0)
        return NULL;
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "format_rows: (list, str, bytes, bool, dict, callable) expected");
        return NULL;
    }
    buffer_t b = {NULL, 0, 0};
    Py_ssize_t n_rows = PyList_GET_SIZE(rows);
    for (Py_ssize_t r = 0; r < n_rows; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 11) {
            PyErr_SetString(PyExc_TypeError, "format_rows: a row is not an 11-tuple");
            goto fail;
        }
        PyObject *numel_obj = PyTuple_GET_ITEM(row, 4);
        if (!PyLong_CheckExact(numel_obj)) {
            PyErr_SetString(PyExc_TypeError, "format_rows: an element count is not an int");
            goto fail;
        }
        long long numel = PyLong_AsLongLong(numel_obj);
        if (numel == -1 && PyErr_Occurred())
            goto fail;
        double mn, mx, total, sumsq;
        if (float_item(row, 5, &mn) < 0 || float_item(row, 6, &mx) < 0 || float_item(row, 7, &total) < 0 ||
            float_item(row, 8, &sumsq) < 0)
            goto fail;
        if (format_one(&b, &f, PyTuple_GET_ITEM(row, 0), PyTuple_GET_ITEM(row, 1), PyTuple_GET_ITEM(row, 2),
                       PyTuple_GET_ITEM(row, 3), numel, mn, mx, total, sumsq, PyTuple_GET_ITEM(row, 9),
                       PyTuple_GET_ITEM(row, 10)) < 0)
            goto fail;
    }
    return buffer_bytes(&b);
fail:
    PyMem_Free(b.data);
    return NULL;
}


/* ---------------------------------------------------------------- Record */

/* stats.Record as a C type without garbage-collector support. A step's records live from
   their hooks to the step's end, through many young collections, so every Python Record
   reached the collector's oldest generation, and with ~15,000 of them per step (every
   module of a deep model) they brought a full collection of the whole process (0.16 s
   with torch loaded) every few steps. A record only refers to strings, ints, tuples of
   floats or a framework tensor, and nothing refers back to it from those: it can be in no
   reference cycle, so the collector has nothing to find in it. Same constructor,
   attributes and methods as the Python class (stats.py), which is used where this is not
   built. */
/* listed: how the vector is kept. VECTOR_OBJECT: ``vector`` as given (a device tensor,
   None); VECTOR_TUPLE: a host list kept as a tuple, read back as a list; VECTOR_INLINE:
   the kernel's four statistics in ``values`` (``vector`` NULL), read back as a list. A
   record of the kernel's then costs no tuple and no float objects: one record is made
   for every tensor observed, and each tuple it held was a garbage-collected object
   that lived until the step was written (with every monitor on, about half of the
   objects that made the collector run during a written step). */
enum { VECTOR_OBJECT = 0, VECTOR_TUPLE = 1, VECTOR_INLINE = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *vpp_stage, *name, *scope, *micro_step, *vector, *nans, *numel, *zeros;
    char listed;
    double values[4]; /* min, max, sum, norm: VECTOR_INLINE */
} RecordObject;

static PyTypeObject RecordType;

static void record_dealloc(RecordObject *self) {
    Py_XDECREF(self->vpp_stage);
    Py_XDECREF(self->name);
    Py_XDECREF(self->scope);
    Py_XDECREF(self->micro_step);
    Py_XDECREF(self->vector);
    Py_XDECREF(self->nans);
    Py_XDECREF(self->numel);
    Py_XDECREF(self->zeros);
    PyObject_Free(self);
}

static RecordObject *record_alloc(void) {
    RecordObject *r = PyObject_New(RecordObject, &RecordType);
    if (r == NULL)
        return NULL;
    r->vpp_stage = r->name = r->scope = r->micro_step = r->vector = r->nans = r->numel = r->zeros = NULL;
    r->listed = 0;
    return r;
}

#define SET_REF(field, value) do { Py_INCREF(value); field = (value); } while (0)

/* a list is kept as a tuple and read back as a list (see stats.Record) */
static int record_store_vector(RecordObject *r, PyObject *vector) {
    if (PyList_CheckExact(vector)) {
        PyObject *t = PyList_AsTuple(vector);
        if (t == NULL)
            return -1;
        Py_XSETREF(r->vector, t);
        r->listed = VECTOR_TUPLE;
    } else {
        Py_INCREF(vector);
        Py_XSETREF(r->vector, vector);
        r->listed = VECTOR_OBJECT;
    }
    return 0;
}

static PyObject *record_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"vpp_stage", "name", "scope", "micro_step", "vector", "nans", "numel", "zeros", NULL};
    PyObject *vpp, *name, *scope, *micro, *vector, *nans, *numel, *zeros = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO|O:Record", kwlist, &vpp, &name, &scope, &micro, &vector,
                                     &nans, &numel, &zeros))
        return NULL;
    RecordObject *r = record_alloc();
    if (r == NULL)
        return NULL;
    SET_REF(r->vpp_stage, vpp);
    SET_REF(r->name, name);
    SET_REF(r->scope, scope);
    SET_REF(r->micro_step, micro);
    SET_REF(r->nans, nans);
    SET_REF(r->numel, numel);
    SET_REF(r->zeros, zeros);
    if (record_store_vector(r, vector) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    return (PyObject *)r;
}

/* The four inline statistics as a new list or tuple. */
static PyObject *inline_vector(const RecordObject *self, int as_tuple) {
    return four_floats(self->values, as_tuple);
}

static PyObject *record_get_vector(RecordObject *self, void *closure) {
    if (self->listed == VECTOR_INLINE)
        return inline_vector(self, 0);
    if (self->listed == VECTOR_TUPLE)
        return PySequence_List(self->vector);
    Py_INCREF(self->vector);
    return self->vector;
}

/* ``_vector``: the vector as stored, a host one as a tuple */
static PyObject *record_get_stored_vector(RecordObject *self, void *closure) {
    if (self->listed == VECTOR_INLINE)
        return inline_vector(self, 1);
    Py_INCREF(self->vector);
    return self->vector;
}

static PyObject *record_get_listed(RecordObject *self, void *closure) {
    return PyBool_FromLong(self->listed != VECTOR_OBJECT);
}

static int record_set_vector(RecordObject *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "vector cannot be deleted");
        return -1;
    }
    return record_store_vector(self, value);
}

static PyObject *record_get_key(RecordObject *self, void *closure) {
    return PyTuple_Pack(4, self->vpp_stage, self->name, self->scope, self->micro_step);
}

/* host(key, vector, nans, numel, zeros): host statistics under the row key ``key``, the
   vector already a tuple (read back as a list) */
/* A new reference to `obj`, or to None where it is NULL (Py_NewRef is Python 3.10's; the
   package supports 3.9). */
static PyObject *ref_or_none(PyObject *obj) {
    obj = obj != NULL ? obj : Py_None;
    Py_INCREF(obj);
    return obj;
}

static PyObject *none_ref(void) {
    return ref_or_none(NULL);
}

/* A record of host statistics under the 4-tuple row key ``key`` (references taken, none
   stolen): Record.host's and records_many's. ``vector`` NULL: an inline vector, its
   values set by the caller (set_inline). */
static PyObject *record_of(PyObject *key, PyObject *vector, PyObject *nans, PyObject *numel, PyObject *zeros) {
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 4) {
        PyErr_SetString(PyExc_TypeError, "a record's key is a 4-tuple (vpp_stage, name, scope, micro_step)");
        return NULL;
    }
    RecordObject *r = record_alloc();
    if (r == NULL)
        return NULL;
    SET_REF(r->vpp_stage, PyTuple_GET_ITEM(key, 0));
    SET_REF(r->name, PyTuple_GET_ITEM(key, 1));
    SET_REF(r->scope, PyTuple_GET_ITEM(key, 2));
    SET_REF(r->micro_step, PyTuple_GET_ITEM(key, 3));
    Py_XINCREF(vector);
    r->vector = vector;
    r->listed = vector == NULL ? VECTOR_INLINE : VECTOR_TUPLE;
    SET_REF(r->nans, nans);
    SET_REF(r->numel, numel);
    SET_REF(r->zeros, zeros);
    return (PyObject *)r;
}

static PyObject *record_host(PyObject *cls, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "Record.host(key, vector, nans, numel, zeros)");
        return NULL;
    }
    return record_of(args[0], args[1], args[2], args[3], args[4]);
}

/* relabelled(vpp_stage, name, scope, micro_step): the statistics under another row key */
static PyObject *record_relabelled(RecordObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "relabelled(vpp_stage, name, scope, micro_step)");
        return NULL;
    }
    RecordObject *r = record_alloc();
    if (r == NULL)
        return NULL;
    SET_REF(r->vpp_stage, args[0]);
    SET_REF(r->name, args[1]);
    SET_REF(r->scope, args[2]);
    SET_REF(r->micro_step, args[3]);
    Py_XINCREF(self->vector);
    r->vector = self->vector;
    r->listed = self->listed;
    memcpy(r->values, self->values, sizeof r->values);
    SET_REF(r->nans, self->nans);
    SET_REF(r->numel, self->numel);
    SET_REF(r->zeros, self->zeros);
    return (PyObject *)r;
}

static PyObject *record_repr(RecordObject *self) {
    PyObject *vector = record_get_vector(self, NULL);
    if (vector == NULL)
        return NULL;
    PyObject *out = PyUnicode_FromFormat(
        "Record(vpp_stage=%R, name=%R, scope=%R, micro_step=%R, vector=%R, nans=%R, numel=%R, zeros=%R)",
        self->vpp_stage, self->name, self->scope, self->micro_step, vector, self->nans, self->numel, self->zeros);
    Py_DECREF(vector);
    return out;
}

static PyMemberDef record_members[] = {
    {"vpp_stage", T_OBJECT, offsetof(RecordObject, vpp_stage), 0, NULL},
    {"name", T_OBJECT, offsetof(RecordObject, name), 0, NULL},
    {"scope", T_OBJECT, offsetof(RecordObject, scope), 0, NULL},
    {"micro_step", T_OBJECT, offsetof(RecordObject, micro_step), 0, NULL},
    {"nans", T_OBJECT, offsetof(RecordObject, nans), 0, NULL},
    {"numel", T_OBJECT, offsetof(RecordObject, numel), 0, NULL},
    {"zeros", T_OBJECT, offsetof(RecordObject, zeros), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef record_getset[] = {
    {"vector", (getter)record_get_vector, (setter)record_set_vector, NULL, NULL},
    {"_vector", (getter)record_get_stored_vector, NULL, NULL, NULL},
    {"_listed", (getter)record_get_listed, NULL, NULL, NULL},
    {"key", (getter)record_get_key, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef record_methods[] = {
    {"host", (PyCFunction)(void (*)(void))record_host, METH_FASTCALL | METH_CLASS, NULL},
    {"relabelled", (PyCFunction)(void (*)(void))record_relabelled, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.Record",
    .tp_basicsize = sizeof(RecordObject),
    .tp_dealloc = (destructor)record_dealloc,
    .tp_repr = (reprfunc)record_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Py_TPFLAGS_HAVE_GC: see above */
    .tp_doc = "One observation of one tensor, before it reaches the host (stats.Record).",
    .tp_methods = record_methods,
    .tp_members = record_members,
    .tp_getset = record_getset,
    .tp_new = record_new,
};


/* The kernel's output as a record's inline vector, as vector_object gives it: min and
   max NaN when there is a NaN, the norm the square root of the sum of squares. */
static void set_inline(PyObject *rec, const double *out, int64_t nans) {
    RecordObject *r = (RecordObject *)rec;
    r->values[0] = nans ? Py_NAN : out[0];
    r->values[1] = nans ? Py_NAN : out[1];
    r->values[2] = out[2];
    r->values[3] = sqrt(out[3]);
    r->listed = VECTOR_INLINE;
}

/* record_read(pointer, count, dtype_code, threads, nans, zeros, vpp_stage, name, scope,
   micro_step) -> Record: one buffer's statistics as a record with an inline vector (the
   NaN count kept where ``nans`` is true, the zero count counted where ``zeros`` is): what
   Record(vpp_stage, name, scope, micro_step, vector, nans, count, zeros) of stats or
   stats_zeros gives, without the vector's list. */
static PyObject *py_record_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "record_read takes 10 arguments");
        return NULL;
    }
    const void *data;
    int64_t n, zeros = 0;
    int dtype, threads;
    if (parse_buffer(args, &data, &n, &dtype, &threads) < 0)
        return NULL;
    int want_nans = PyObject_IsTrue(args[4]);
    int want_zeros = PyObject_IsTrue(args[5]);
    if (want_nans < 0 || want_zeros < 0)
        return NULL;
    double out[4];
    int64_t nans = run_stats(data, n, dtype, threads, out, want_zeros ? &zeros : NULL);
    RecordObject *r = record_alloc();
    if (r == NULL)
        return NULL;
    SET_REF(r->vpp_stage, args[6]);
    SET_REF(r->name, args[7]);
    SET_REF(r->scope, args[8]);
    SET_REF(r->micro_step, args[9]);
    SET_REF(r->numel, args[1]);
    r->nans = want_nans ? PyLong_FromLongLong(nans) : none_ref();
    r->zeros = want_zeros ? PyLong_FromLongLong(zeros) : none_ref();
    if (r->nans == NULL || r->zeros == NULL) {
        Py_DECREF(r);
        return NULL;
    }
    set_inline((PyObject *)r, out, nans);
    return (PyObject *)r;
}

/* records_many(keys, pointers, counts, dtype_codes, threads, nans, zeros) -> [Record, ...]:
   stats_many and Record.host in one call, the records built here (key i a 4-tuple row key;
   the NaN count kept where `nans` is true, the zero count counted where `zeros` is), each
   exactly what Record.host(key, vector, nans, numel, zeros) of stats_many's item i gives. */
static PyObject *py_records_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "records_many takes 7 arguments");
        return NULL;
    }
    batch_t batch = {NULL, NULL, NULL, 0};
    PyObject *out = NULL;
    PyObject *keys = PySequence_Fast(args[0], "records_many: keys must be a sequence");
    int threads = (int)PyLong_AsLong(args[4]);
    int want_nans = PyObject_IsTrue(args[5]);
    int want_zeros = PyObject_IsTrue(args[6]);
    if (keys == NULL || (threads == -1 && PyErr_Occurred()) || want_nans < 0 || want_zeros < 0 ||
        batch_open(&batch, args[1], args[2], args[3], PySequence_Fast_GET_SIZE(keys), "records_many") < 0)
        goto done;
    out = PyList_New(batch.n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < batch.n; i++) {
        double stats_out[4];
        int64_t zeros = 0;
        int64_t nans = batch_read(&batch, i, threads, stats_out, want_zeros ? &zeros : NULL);
        if (nans < 0)
            goto fail;
        PyObject *nan_count = want_nans ? PyLong_FromLongLong(nans) : none_ref();
        PyObject *zero_count = want_zeros ? PyLong_FromLongLong(zeros) : none_ref();
        PyObject *rec = nan_count && zero_count ?
            record_of(PySequence_Fast_GET_ITEM(keys, i), NULL, nan_count, PySequence_Fast_GET_ITEM(batch.counts, i),
                      zero_count) : NULL;
        Py_XDECREF(nan_count);
        Py_XDECREF(zero_count);
        if (rec == NULL)
            goto fail;
        set_inline(rec, stats_out, nans);
        PyList_SET_ITEM(out, i, rec);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(keys);
    batch_close(&batch);
    return out;
}

/* ------------------------------------------------------------ merge_fields */

/* A field of a record: the C type's own, another object's attribute (new reference). */
static PyObject *field(PyObject *rec, size_t offset, const char *attr) {
    if (Py_IS_TYPE(rec, &RecordType)) {
        PyObject *v = *(PyObject **)((char *)rec + offset);
        Py_XINCREF(v);
        if (v == NULL)
            PyErr_SetString(PyExc_TypeError, "merge_fields: an uninitialised record");
        return v;
    }
    return PyObject_GetAttrString(rec, attr);
}

/* int(value or 0), as stats.merge_fields counts NaNs and zeros */
static PyObject *count_of(PyObject *value) {
    if (PyLong_CheckExact(value)) {
        Py_INCREF(value);
        return value;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0)
        return NULL;
    return truth ? PyNumber_Long(value) : PyLong_FromLong(0);
}

static int vector_float(PyObject *vector, Py_ssize_t i, double *out) {
    PyObject *item = PyTuple_GET_ITEM(vector, i);
    if (!PyFloat_CheckExact(item)) {
        PyErr_SetString(PyExc_TypeError, "merge_fields: a statistic is not a float");
        return -1;
    }
    *out = PyFloat_AS_DOUBLE(item);
    return 0;
}

static double nan_min(double a, double b) { return (isnan(a) || isnan(b)) ? Py_NAN : (a <= b ? a : b); }
static double nan_max(double a, double b) { return (isnan(a) || isnan(b)) ? Py_NAN : (a >= b ? a : b); }

/* A merged row, in C: merge_fields builds its tuple, format_records formats it directly
   (no tuple and no float objects per row). The object fields are owned references. */
typedef struct {
    PyObject *key[4]; /* vpp_stage, name, scope, micro_step */
    Py_hash_t hash;   /* of the key, as a tuple's items hash */
    PyObject *numel, *nans, *zeros;
    double mn, mx, total, sumsq;
} merged_t;

/* The merged rows in the order their keys first appear, and an open-addressing table of
   their positions by key (the keys compare as the 4-tuples stats.merge_fields uses as
   dict keys: same hash, items equal by identity or ==). No object is made per record. */
typedef struct {
    merged_t *rows;
    Py_ssize_t n, cap;
    Py_ssize_t *table; /* position + 1; 0: empty */
    size_t mask;
} merged_list_t;

/* key + (numel, min, max, total, sumsq, nans, zeros) */
static PyObject *row_tuple(const merged_t *r) {
    PyObject *row = PyTuple_New(11);
    if (row == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < 4; i++) {
        Py_INCREF(r->key[i]);
        PyTuple_SET_ITEM(row, i, r->key[i]);
    }
    Py_INCREF(r->numel);
    PyTuple_SET_ITEM(row, 4, r->numel);
    double values[4] = {r->mn, r->mx, r->total, r->sumsq};
    for (Py_ssize_t i = 0; i < 4; i++) {
        PyObject *f = PyFloat_FromDouble(values[i]);
        if (f == NULL) {
            Py_DECREF(row);
            return NULL;
        }
        PyTuple_SET_ITEM(row, 5 + i, f);
    }
    Py_INCREF(r->nans);
    PyTuple_SET_ITEM(row, 9, r->nans);
    Py_INCREF(r->zeros);
    PyTuple_SET_ITEM(row, 10, r->zeros);
    return row;
}

static void merged_free(merged_list_t *m) {
    for (Py_ssize_t i = 0; i < m->n; i++) {
        for (int k = 0; k < 4; k++)
            Py_XDECREF(m->rows[i].key[k]);
        Py_XDECREF(m->rows[i].numel);
        Py_XDECREF(m->rows[i].nans);
        Py_XDECREF(m->rows[i].zeros);
    }
    PyMem_Free(m->rows);
    PyMem_Free(m->table);
    m->rows = NULL;
    m->table = NULL;
    m->n = m->cap = 0;
    m->mask = 0;
}

/* The row of `key` (hash `hash`): its position, or -1 with *slot the empty slot to put
   it in; -2 on an error (an item's == raised). */
static Py_ssize_t merged_find(merged_list_t *m, PyObject *const key[4], Py_hash_t hash, size_t *slot) {
    size_t i = (size_t)hash & m->mask;
    for (;;) {
        Py_ssize_t at = m->table[i];
        if (at == 0) {
            *slot = i;
            return -1;
        }
        merged_t *row = &m->rows[at - 1];
        if (row->hash == hash) {
            int equal = 1;
            for (int k = 0; k < 4 && equal; k++) {
                if (row->key[k] != key[k]) {
                    equal = PyObject_RichCompareBool(row->key[k], key[k], Py_EQ);
                    if (equal < 0)
                        return -2;
                }
            }
            if (equal)
                return at - 1;
        }
        i = (i + 1) & m->mask;
    }
}

/* Merge one record into `m`. */
static int merge_one(PyObject *rec, merged_list_t *m) {
    PyObject *vector = NULL, *nans = NULL, *zeros = NULL, *numel = NULL, *raw = NULL;
    PyObject *key[4] = {NULL, NULL, NULL, NULL};
    int ok = 0;
    const double *values = NULL; /* an inline vector's */
    if (Py_IS_TYPE(rec, &RecordType) && ((RecordObject *)rec)->listed == VECTOR_INLINE) {
        values = ((RecordObject *)rec)->values;
        vector = Py_None; /* not read: a placeholder past the checks below */
        Py_INCREF(vector);
    } else if ((vector = field(rec, offsetof(RecordObject, vector), "_vector")) == NULL) {
        goto done;
    } else if (vector == Py_None) { /* unobserved: no row */
        ok = 1;
        goto done;
    }
    if (values == NULL && (!PyTuple_CheckExact(vector) || PyTuple_GET_SIZE(vector) < 4)) {
        PyErr_SetString(PyExc_TypeError, "merge_fields: a vector is not a host tuple");
        goto done;
    }
    if ((raw = field(rec, offsetof(RecordObject, nans), "nans")) == NULL || (nans = count_of(raw)) == NULL)
        goto done;
    Py_CLEAR(raw);
    if ((raw = field(rec, offsetof(RecordObject, zeros), "zeros")) == NULL || (zeros = count_of(raw)) == NULL)
        goto done;
    if ((numel = field(rec, offsetof(RecordObject, numel), "numel")) == NULL)
        goto done;
    if (!PyLong_CheckExact(numel)) {
        PyErr_SetString(PyExc_TypeError, "merge_fields: an element count is not an int");
        goto done;
    }
    double mn, mx, total, norm;
    if (values != NULL) {
        mn = values[0], mx = values[1], total = values[2], norm = values[3];
    } else if (vector_float(vector, 0, &mn) < 0 || vector_float(vector, 1, &mx) < 0 ||
               vector_float(vector, 2, &total) < 0 || vector_float(vector, 3, &norm) < 0) {
        goto done;
    }
    int has_nans = PyObject_IsTrue(nans);
    if (has_nans < 0)
        goto done;
    if (has_nans) /* some kernels skip NaN in min/max; the spec never hides it */
        mn = mx = Py_NAN;
    if ((key[0] = field(rec, offsetof(RecordObject, vpp_stage), "vpp_stage")) == NULL ||
        (key[1] = field(rec, offsetof(RecordObject, name), "name")) == NULL ||
        (key[2] = field(rec, offsetof(RecordObject, scope), "scope")) == NULL ||
        (key[3] = field(rec, offsetof(RecordObject, micro_step), "micro_step")) == NULL)
        goto done;
    Py_uhash_t acc = 0x345678UL; /* mixed as tuple items are, so equal keys hash equal */
    for (int k = 0; k < 4; k++) {
        Py_hash_t h = PyObject_Hash(key[k]);
        if (h == -1)
            goto done;
        acc = (acc ^ (Py_uhash_t)h) * 1000003UL;
    }
    Py_hash_t hash = (Py_hash_t)acc;
    size_t slot;
    Py_ssize_t at = merged_find(m, key, hash, &slot);
    if (at == -2)
        goto done;
    if (at == -1) {
        merged_t *row = &m->rows[m->n++];
        m->table[slot] = m->n;
        for (int k = 0; k < 4; k++) { /* references moved into the row */
            row->key[k] = key[k];
            key[k] = NULL;
        }
        row->hash = hash;
        row->numel = numel;
        row->nans = nans;
        row->zeros = zeros;
        numel = nans = zeros = NULL;
        row->mn = mn;
        row->mx = mx;
        row->total = total;
        row->sumsq = norm * norm;
        ok = 1;
        goto done;
    }
    /* Stat.merge: the same row key seen again */
    merged_t *row = &m->rows[at];
    int numel_true = PyObject_IsTrue(numel);
    if (numel_true < 0)
        goto done;
    if (!numel_true) { /* an empty record adds nothing */
        ok = 1;
        goto done;
    }
    int old_empty = PyObject_Not(row->numel);
    if (old_empty < 0)
        goto done;
    PyObject *sum_numel = PyNumber_Add(row->numel, numel);
    PyObject *sum_nans = sum_numel ? PyNumber_Add(row->nans, nans) : NULL;
    PyObject *sum_zeros = sum_nans ? PyNumber_Add(row->zeros, zeros) : NULL;
    if (sum_zeros == NULL) {
        Py_XDECREF(sum_numel);
        Py_XDECREF(sum_nans);
        goto done;
    }
    row->mn = old_empty ? mn : nan_min(row->mn, mn);
    row->mx = old_empty ? mx : nan_max(row->mx, mx);
    row->total += total;
    row->sumsq += norm * norm;
    Py_SETREF(row->numel, sum_numel);
    Py_SETREF(row->nans, sum_nans);
    Py_SETREF(row->zeros, sum_zeros);
    ok = 1;
done:
    Py_XDECREF(vector);
    Py_XDECREF(raw);
    Py_XDECREF(nans);
    Py_XDECREF(zeros);
    Py_XDECREF(numel);
    for (int k = 0; k < 4; k++)
        Py_XDECREF(key[k]);
    return ok ? 0 : -1;
}

/* stats.merge_fields's merge of `records` (a list) into `m`, rows in the order their
   keys first appear; host vectors that are tuples of floats only (anything else raises
   TypeError; the caller then merges in Python). */
static int merge_records(PyObject *records, merged_list_t *m) {
    if (!PyList_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "merge_fields: a list of records expected");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(records);
    size_t size = 16;
    while (size < 2 * (size_t)n) /* at most half full: short probes */
        size *= 2;
    m->rows = PyMem_Malloc((n ? n : 1) * sizeof *m->rows);
    m->table = PyMem_Calloc(size, sizeof *m->table);
    m->cap = n;
    m->mask = size - 1;
    if (m->rows == NULL || m->table == NULL) {
        merged_free(m);
        PyErr_NoMemory();
        return -1;
    }
    /* a record's == (a key item of another type) may run Python code: the list is held */
    Py_INCREF(records);
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(records); i++) {
        if (merge_one(PyList_GET_ITEM(records, i), m) < 0) {
            Py_DECREF(records);
            merged_free(m);
            return -1;
        }
    }
    Py_DECREF(records);
    return 0;
}

/* merge_fields(records) -> [(vpp_stage, name, scope, micro_step, numel, min, max, total,
   sumsq, nans, zeros), ...]: stats.merge_fields. */
static PyObject *py_merge_fields(PyObject *self, PyObject *records) {
    merged_list_t m = {NULL, 0, 0, NULL, 0};
    if (merge_records(records, &m) < 0)
        return NULL;
    PyObject *rows = PyList_New(m.n);
    for (Py_ssize_t i = 0; rows != NULL && i < m.n; i++) {
        merged_t *r = &m.rows[i];
        PyObject *row = row_tuple(r);
        if (row == NULL)
            Py_CLEAR(rows);
        else
            PyList_SET_ITEM(rows, i, row);
    }
    merged_free(&m);
    return rows;
}

/* format_records(records, step_text, op_codes, with_micro_step, cells, cell_fn) ->
   (bytes, rows): merge_fields and format_rows in one call, the merged rows formatted
   from C (the writer's path when no alert or dashboard needs the rows as objects). The
   bytes are those format_rows gives for merge_fields(records). */
static PyObject *py_format_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "format_records takes 6 arguments");
        return NULL;
    }
    row_format_t f;
    if (row_format_parse(args + 1, &f) < 0)
        return NULL;
    merged_list_t m = {NULL, 0, 0, NULL, 0};
    if (merge_records(args[0], &m) < 0)
        return NULL;
    buffer_t b = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < m.n; i++) {
        merged_t *r = &m.rows[i];
        long long numel = PyLong_AsLongLong(r->numel);
        if ((numel == -1 && PyErr_Occurred()) ||
            format_one(&b, &f, r->key[0], r->key[1], r->key[2], r->key[3], numel, r->mn, r->mx, r->total,
                       r->sumsq, r->nans, r->zeros) < 0) {
            PyMem_Free(b.data);
            merged_free(&m);
            return NULL;
        }
    }
    Py_ssize_t n = m.n;
    merged_free(&m);
    PyObject *data = buffer_bytes(&b);
    if (data == NULL)
        return NULL;
    PyObject *result = Py_BuildValue("(Nn)", data, n);
    return result;
}

/* not_on_host(records) -> the records whose vector is not a host tuple, or whose NaN or
   zero count is neither an int nor None (those to_host moves); the kernel's records are
   host ones already, and a step of the deep benchmark holds 9,000 of them. */
static PyObject *py_not_on_host(PyObject *self, PyObject *records) {
    if (!PyList_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "not_on_host: a list of records expected");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        int host;
        if (Py_IS_TYPE(rec, &RecordType)) {
            RecordObject *r = (RecordObject *)rec;
            host = (r->listed == VECTOR_INLINE || (r->vector != NULL && PyTuple_CheckExact(r->vector))) &&
                   r->nans != NULL &&
                   (r->nans == Py_None || PyLong_CheckExact(r->nans)) && r->zeros != NULL &&
                   (r->zeros == Py_None || PyLong_CheckExact(r->zeros));
        } else {
            host = 0; /* another class: to_host looks at it */
        }
        if (!host && PyList_Append(out, rec) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* ------------------------------------------------------------ entries found again
 * entries_again(state, keys, entries, where, ids, cls, firsts, seconds) -> list or None
 *
 * The passes of StateListing.again (the optimizer's state tensors, state_listing.py) in
 * one: `state` is a dict whose keys are, in their order, the objects of the list `keys`
 * (compared by identity), and whose values are dicts with `entries` entries in all. The
 * entries at the places `where` (counted over all those dicts, one after the other)
 * must be the objects whose ids are `ids`, each an instance of `cls`. Then the list of
 * (firsts[i], seconds[i], entry i) tuples; otherwise None: the state changed and is
 * listed again. Nothing is kept after the call, and no Python code runs while the dicts
 * are walked. */
static PyObject *py_entries_again(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "entries_again: 8 arguments expected");
        return NULL;
    }
    PyObject *state = args[0], *keys = args[1], *where = args[3], *ids = args[4], *cls = args[5];
    PyObject *firsts = args[6], *seconds = args[7];
    Py_ssize_t entries = PyLong_AsSsize_t(args[2]);
    if (entries == -1 && PyErr_Occurred())
        return NULL;
    if (!PyDict_Check(state) || !PyList_Check(keys) || !PyList_Check(where) || !PyList_Check(ids) ||
        !PyType_Check(cls) || !PyList_Check(firsts) || !PyList_Check(seconds) || entries < 0) {
        PyErr_SetString(PyExc_TypeError, "entries_again: (dict, list, int >= 0, list, list, type, list, list) expected");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(where);
    if (PyList_GET_SIZE(ids) != n || PyList_GET_SIZE(firsts) != n || PyList_GET_SIZE(seconds) != n) {
        PyErr_SetString(PyExc_ValueError, "entries_again: where, ids, firsts and seconds differ in length");
        return NULL;
    }
    if (PyDict_GET_SIZE(state) != PyList_GET_SIZE(keys))
        Py_RETURN_NONE;
    /* allocated before the walk: an allocation can run the garbage collector, and with it
       Python code that could change the dicts */
    PyObject **flat = PyMem_Malloc(sizeof(PyObject *) * (size_t)(entries > 0 ? entries : 1));
    PyObject *out = PyList_New(n);
    if (flat == NULL || out == NULL) {
        PyMem_Free(flat);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    Py_ssize_t pos = 0, i = 0, filled = 0;
    PyObject *key, *value;
    while (PyDict_Next(state, &pos, &key, &value)) {
        if (key != PyList_GET_ITEM(keys, i++) || !PyDict_Check(value))
            goto changed;
        Py_ssize_t inner = 0;
        PyObject *name, *entry;
        while (PyDict_Next(value, &inner, &name, &entry)) {
            if (filled == entries)
                goto changed;
            flat[filled++] = entry;
        }
    }
    if (filled != entries)
        goto changed;
    for (Py_ssize_t j = 0; j < n; j++) {  /* still no allocation: each entry is checked and held */
        Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(where, j));
        void *id = PyLong_AsVoidPtr(PyList_GET_ITEM(ids, j));
        if (PyErr_Occurred())
            goto failed;
        if (at < 0 || at >= entries || (void *)flat[at] != id || !PyObject_TypeCheck(flat[at], (PyTypeObject *)cls))
            goto changed; /* the entries held so far are released with `out`; the dicts still hold them */
        Py_INCREF(flat[at]);
        PyList_SET_ITEM(out, j, flat[at]);
    }
    PyMem_Free(flat);
    for (Py_ssize_t j = 0; j < n; j++) {  /* the entries are held now: tuples may allocate */
        PyObject *entry = PyList_GET_ITEM(out, j);
        PyObject *triple = PyTuple_Pack(3, PyList_GET_ITEM(firsts, j), PyList_GET_ITEM(seconds, j), entry);
        if (triple == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, triple);
        Py_DECREF(entry);
    }
    return out;
changed:
    PyMem_Free(flat);
    Py_DECREF(out);
    Py_RETURN_NONE;
failed:
    PyMem_Free(flat);
    Py_DECREF(out);
    return NULL;
}

/* ------------------------------------------------------------------ weight_grad's file order
 * monitor.weight_grad_rows in one call: the unreduced records in the order of their keys
 * (tuples of up to four ints: parameter index, micro step, row...), then the reduced
 * ones, the accumulated rows (micro step 0 in the key) and the reduced rows carrying the
 * step's number of micro-batches. In Python a step of 1,000 parameters spent about
 * 0.3 ms here (sorting tuples, hashing each key again to fetch its record, and setting
 * micro_step through the attribute machinery). None, with nothing changed, where a key
 * or a record is not what this reads (the Python code then does the same work). */
#define ORDER_KEY_MAX 4
typedef struct {
    long long k[ORDER_KEY_MAX];
    int len;
    PyObject *rec; /* borrowed: the dict holds it */
} order_entry_t;

static int order_compare(const void *pa, const void *pb) {
    const order_entry_t *a = pa, *b = pb;
    int n = a->len < b->len ? a->len : b->len;
    for (int i = 0; i < n; i++)
        if (a->k[i] != b->k[i])
            return a->k[i] < b->k[i] ? -1 : 1;
    return (a->len > b->len) - (a->len < b->len); /* a prefix first, as tuples compare */
}

/* Sorted by key. The backward pass reaches the parameters in about the reverse of their
   order, and a model's pass order stays from step to step: a run in either direction
   costs one comparison per entry instead of a merge sort. */
static void order_sort(order_entry_t *e, Py_ssize_t n) {
    Py_ssize_t up = 1, down = 1;
    for (Py_ssize_t i = 1; i < n && (up || down); i++) {
        int c = order_compare(&e[i - 1], &e[i]);
        up = up && c < 0;
        down = down && c > 0;
    }
    if (up)
        return;
    if (down) {
        for (Py_ssize_t i = 0, j = n - 1; i < j; i++, j--) {
            order_entry_t t = e[i];
            e[i] = e[j];
            e[j] = t;
        }
        return;
    }
    qsort(e, (size_t)n, sizeof(order_entry_t), order_compare);
}

static int order_key(PyObject *key, order_entry_t *e) {
    if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) < 1 || PyTuple_GET_SIZE(key) > ORDER_KEY_MAX)
        return 0;
    e->len = (int)PyTuple_GET_SIZE(key);
    for (int i = 0; i < e->len; i++) {
        PyObject *item = PyTuple_GET_ITEM(key, i);
        if (!PyLong_CheckExact(item))
            return 0;
        int overflow = 0;
        e->k[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || (e->k[i] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static void set_micro(PyObject *rec, PyObject *micro) {
    RecordObject *r = (RecordObject *)rec;
    Py_INCREF(micro);
    Py_XSETREF(r->micro_step, micro);
}

/* file_order(unreduced: dict, reduced: list, passes: dict, announced: int) -> list or None */
static PyObject *py_file_order(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "file_order takes 4 arguments");
        return NULL;
    }
    PyObject *unreduced = args[0], *reduced = args[1], *passes = args[2], *announced = args[3];
    if (!PyDict_CheckExact(unreduced) || !PyList_CheckExact(reduced) || !PyDict_CheckExact(passes) ||
        !PyLong_CheckExact(announced))
        Py_RETURN_NONE;
    PyObject *micro = NULL, *key, *value;
    Py_ssize_t pos = 0;
    long long most = 0;
    int any = 0;
    while (PyDict_Next(passes, &pos, &key, &value)) { /* max(passes.values(), default=0) */
        if (!PyLong_CheckExact(value))
            Py_RETURN_NONE;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (!any || v > most) {
            most = v;
            micro = value; /* borrowed: the dict holds it */
            any = 1;
        }
    }
    if (micro == NULL || most == 0) /* `or announced`: no pass, or a maximum of 0 */
        micro = announced;
    Py_ssize_t n = PyDict_GET_SIZE(unreduced), m = PyList_GET_SIZE(reduced);
    /* allocated before the walk: an allocation can run the garbage collector, and with it
       Python code that could change the dict */
    order_entry_t *entries = PyMem_Malloc(sizeof(order_entry_t) * (size_t)(n > 0 ? n : 1));
    PyObject *out = PyList_New(n + m);
    if (entries == NULL || out == NULL) {
        PyMem_Free(entries);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    Py_INCREF(micro); /* held while the records change: it may be one of theirs */
    Py_ssize_t i = 0;
    pos = 0;
    while (PyDict_Next(unreduced, &pos, &key, &value)) {
        if (i == n || !order_key(key, &entries[i]) || !Py_IS_TYPE(value, &RecordType))
            goto unread;
        entries[i++].rec = value;
    }
    for (Py_ssize_t j = 0; j < m; j++)
        if (!Py_IS_TYPE(PyList_GET_ITEM(reduced, j), &RecordType))
            goto unread;
    if (i != n)
        goto unread;
    order_sort(entries, n);
    for (Py_ssize_t j = 0; j < n; j++) { /* held by `out` first: releasing an old micro_step may run code */
        Py_INCREF(entries[j].rec);
        PyList_SET_ITEM(out, j, entries[j].rec);
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *rec = PyList_GET_ITEM(reduced, j);
        Py_INCREF(rec);
        PyList_SET_ITEM(out, n + j, rec);
    }
    for (Py_ssize_t j = 0; j < n + m; j++)
        if (j >= n || (entries[j].len > 1 && entries[j].k[1] == 0))
            set_micro(PyList_GET_ITEM(out, j), micro);
    PyMem_Free(entries);
    Py_DECREF(micro);
    return out;
unread:
    PyMem_Free(entries);
    Py_DECREF(micro);
    Py_DECREF(out); /* its empty slots are NULL: nothing else to release */
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ graph walk
 * edges_into(known, classify, target, roots, boundary) -> [(node, edge index), ...]
 *
 * module.py's _edges_into: walking an autograd graph from the nodes `roots` (a list),
 * depth first as the Python loop does (a stack, each node once), the edges equal to
 * `target` (a (node, output number) tuple) found in each node's next_functions, in the
 * order the loop finds them. A child is walked into where it is not a leaf accumulator
 * and its _sequence_nr() is at least `boundary` (made inside the module call). `known`
 * is the dict type -> bool (accumulates into a leaf) the Python side keeps; a type not
 * in it is asked of `classify(child)`, which adds it. Every step is the Python
 * loop's own operation (==, the set, the same calls on the nodes), in C. */
static PyObject *str_next_functions, *str_sequence_nr;

/* Whether two graph edges, (node, output number) tuples, are unequal because their nodes
   are two objects compared by identity (as graph nodes are): what == would find, without
   its calls. 0 where == has to be asked. */
static int equal_by_identity(PyObject *x) {
    return Py_TYPE(x)->tp_richcompare == PyBaseObject_Type.tp_richcompare;
}

static int identity_unequal(PyObject *a, PyObject *b) {
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b) || PyTuple_GET_SIZE(a) != 2 || PyTuple_GET_SIZE(b) != 2)
        return 0;
    PyObject *x = PyTuple_GET_ITEM(a, 0), *y = PyTuple_GET_ITEM(b, 0);
    return x != y && equal_by_identity(x) && equal_by_identity(y);
}

/* The walk's visited nodes: a few, in an array compared by identity (a set costs its
   allocation and a hash a node), as long as every node is of a type compared by identity
   (graph nodes are); a set from the first one that is not, or past VISITED_SMALL. */
#define VISITED_SMALL 16
typedef struct {
    PyObject *small[VISITED_SMALL];
    int n;
    PyObject *set;
} visited_t;

static int by_identity(PyObject *x) {
    return equal_by_identity(x) && Py_TYPE(x)->tp_hash == PyBaseObject_Type.tp_hash;
}

static int visited_to_set(visited_t *v) {
    if ((v->set = PySet_New(NULL)) == NULL)
        return -1;
    int failed = 0;
    for (int i = 0; i < v->n; i++) {
        failed = failed || PySet_Add(v->set, v->small[i]) < 0;
        Py_DECREF(v->small[i]);
    }
    v->n = 0;
    return failed ? -1 : 0;
}

static int visited_contains(visited_t *v, PyObject *node) {
    if (v->set == NULL && !by_identity(node) && visited_to_set(v) < 0)
        return -1;
    if (v->set != NULL)
        return PySet_Contains(v->set, node);
    for (int i = 0; i < v->n; i++)
        if (v->small[i] == node)
            return 1;
    return 0;
}

static int visited_add(visited_t *v, PyObject *node) {
    if (v->set == NULL && (v->n == VISITED_SMALL || !by_identity(node)) && visited_to_set(v) < 0)
        return -1;
    if (v->set != NULL)
        return PySet_Add(v->set, node);
    Py_INCREF(node);
    v->small[v->n++] = node;
    return 0;
}

static void visited_free(visited_t *v) {
    for (int i = 0; i < v->n; i++)
        Py_DECREF(v->small[i]);
    v->n = 0;
    Py_CLEAR(v->set);
}

static PyObject *py_edges_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "edges_into(known: dict, classify, target, roots: list, boundary)");
        return NULL;
    }
    PyObject *known = args[0], *classify = args[1], *target = args[2], *boundary = args[4];
    PyObject *found = PyList_New(0);
    visited_t visited = {{NULL}, 0, NULL};
    PyObject *stack = PyList_GetSlice(args[3], 0, PyList_GET_SIZE(args[3]));
    PyObject *node = NULL, *edges = NULL;
    if (found == NULL || stack == NULL)
        goto fail;
    while (PyList_GET_SIZE(stack) > 0) {
        Py_ssize_t top = PyList_GET_SIZE(stack) - 1;
        node = PyList_GET_ITEM(stack, top);
        Py_INCREF(node);
        if (PyList_SetSlice(stack, top, top + 1, NULL) < 0)
            goto fail;
        int seen = visited_contains(&visited, node);
        if (seen < 0)
            goto fail;
        if (seen) {
            Py_CLEAR(node);
            continue;
        }
        if (visited_add(&visited, node) < 0)
            goto fail;
        edges = PyObject_GetAttr(node, str_next_functions);
        if (edges == NULL)
            goto fail;
        if (!PyTuple_Check(edges)) {
            PyErr_SetString(PyExc_TypeError, "edges_into: next_functions is not a tuple");
            goto fail;
        }
        for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(edges); e++) {
            PyObject *edge = PyTuple_GET_ITEM(edges, e);
            int equal = identity_unequal(edge, target) ? 0 : PyObject_RichCompareBool(edge, target, Py_EQ);
            if (equal < 0)
                goto fail;
            if (equal) {
                PyObject *index = PyLong_FromSsize_t(e);
                PyObject *pair = index == NULL ? NULL : PyTuple_Pack(2, node, index);
                Py_XDECREF(index);
                if (pair == NULL)
                    goto fail;
                int failed = PyList_Append(found, pair);
                Py_DECREF(pair);
                if (failed < 0)
                    goto fail;
                continue;
            }
            if (!PyTuple_Check(edge) || PyTuple_GET_SIZE(edge) < 1) {
                PyErr_SetString(PyExc_TypeError, "edges_into: an edge is not a tuple");
                goto fail;
            }
            PyObject *child = PyTuple_GET_ITEM(edge, 0);
            if (child == Py_None)
                continue;
            Py_INCREF(child); /* the calls below may run Python code */
            PyObject *leaf = PyDict_GetItemWithError(known, (PyObject *)Py_TYPE(child)); /* borrowed */
            int is_leaf;
            if (leaf != NULL) {
                is_leaf = PyObject_IsTrue(leaf);
            } else if (PyErr_Occurred()) {
                is_leaf = -1;
            } else {
                PyObject *asked = PyObject_CallOneArg(classify, child);
                is_leaf = asked == NULL ? -1 : PyObject_IsTrue(asked);
                Py_XDECREF(asked);
            }
            int walk = 0;
            if (is_leaf == 0) {
                PyObject *seq = PyObject_CallMethodNoArgs(child, str_sequence_nr);
                walk = seq == NULL ? -1 : PyObject_RichCompareBool(seq, boundary, Py_GE);
                Py_XDECREF(seq);
                if (walk > 0) {
                    int in = visited_contains(&visited, child);
                    walk = in < 0 ? -1 : !in;
                }
            }
            if (is_leaf < 0 || walk < 0 || (walk > 0 && PyList_Append(stack, child) < 0)) {
                Py_DECREF(child);
                goto fail;
            }
            Py_DECREF(child);
        }
        Py_CLEAR(edges);
        Py_CLEAR(node);
    }
    visited_free(&visited);
    Py_DECREF(stack);
    return found;
fail:
    Py_XDECREF(node);
    Py_XDECREF(edges);
    Py_XDECREF(found);
    visited_free(&visited);
    Py_XDECREF(stack);
    return NULL;
}

/* ------------------------------------------------------------------ batched grad notes
 * weight_grad's post-accumulate hook of a batched parameter (weight_grad.py,
 * _BatchedGradHook) runs for every parameter in every backward pass; in Python it costs
 * about 2 us, more than the statistics of a small tensor. GradNote is the steady-state
 * part of that hook: once the Python hook has checked the running backward pass (its
 * graph task) and queued the end-of-pass read, it arms the shared NoteState with the
 * pass's task id, and every later hook of that pass only counts the pass and notes the
 * parameter's source here. Anything else (the monitor not active, another graph task, a
 * second post-accumulate hook on the tensor, an error) goes to the Python hook, which
 * does the whole work as before. Both types can sit in reference cycles (monitor ->
 * source -> parameter -> its hooks -> GradNote -> monitor), so they take part in GC. */
typedef struct {
    PyObject_HEAD
    long long task;          /* the graph task the notes are armed for; -1: disarmed */
    long long micro_batches; /* a source is noted from this pass count on */
    PyObject *pending;       /* list: the sources noted in the armed pass */
    PyObject *passes;        /* dict: source index -> passes counted this step */
    PyObject *task_id;       /* callable: the running graph task's id */
    double busy;             /* seconds spent in armed notes, taken by the monitor */
} NoteStateObject;

/* tp_dealloc of the collector-tracked types below: untracked first, then their own tp_clear */
static void gc_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Py_TYPE(self)->tp_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static int note_state_traverse(NoteStateObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->pending);
    Py_VISIT(self->passes);
    Py_VISIT(self->task_id);
    return 0;
}

static int note_state_clear(NoteStateObject *self) {
    Py_CLEAR(self->pending);
    Py_CLEAR(self->passes);
    Py_CLEAR(self->task_id);
    return 0;
}

static PyObject *note_state_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"task_id", NULL};
    PyObject *task_id;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:NoteState", kwlist, &task_id))
        return NULL;
    NoteStateObject *s = (NoteStateObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->task = -1;
    s->micro_batches = 1;
    s->busy = 0.0;
    s->pending = PyList_New(0);
    s->passes = PyDict_New();
    Py_INCREF(task_id);
    s->task_id = task_id;
    if (s->pending == NULL || s->passes == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static PyMemberDef note_state_members[] = {
    {"task", T_LONGLONG, offsetof(NoteStateObject, task), 0, "armed graph task id, -1 disarmed"},
    {"micro_batches", T_LONGLONG, offsetof(NoteStateObject, micro_batches), 0, NULL},
    {"pending", T_OBJECT_EX, offsetof(NoteStateObject, pending), 0, "list of noted sources"},
    {"passes", T_OBJECT_EX, offsetof(NoteStateObject, passes), 0, "dict: source index -> passes"},
    {"busy", T_DOUBLE, offsetof(NoteStateObject, busy), 0, "seconds in armed notes"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject NoteStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.NoteState",
    .tp_basicsize = sizeof(NoteStateObject),
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The state GradNote hooks share: armed task, pending sources, pass counts.",
    .tp_traverse = (traverseproc)note_state_traverse,
    .tp_clear = (inquiry)note_state_clear,
    .tp_members = note_state_members,
    .tp_new = note_state_new,
};

typedef struct {
    PyObject_HEAD
    PyObject *monitor; /* read for ``active`` */
    PyObject *source;  /* appended to state.pending */
    PyObject *index;   /* source.index, the key in state.passes */
    PyObject *state;   /* NoteState */
    PyObject *slow;    /* the Python hook, slow(source, tensor): everything but the armed case */
    PyObject *hooks;   /* NULL, or the tensor's post-accumulate hook dict this hook is in */
} GradNoteObject;

static PyObject *str_active, *str_hooks_attr;

static int grad_note_traverse(GradNoteObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->monitor);
    Py_VISIT(self->source);
    Py_VISIT(self->index);
    Py_VISIT(self->state);
    Py_VISIT(self->slow);
    Py_VISIT(self->hooks);
    return 0;
}

static int grad_note_clear(GradNoteObject *self) {
    Py_CLEAR(self->monitor);
    Py_CLEAR(self->source);
    Py_CLEAR(self->index);
    Py_CLEAR(self->state);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->hooks);
    return 0;
}

static PyObject *grad_note_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor", "source", "index", "state", "slow", NULL};
    PyObject *monitor, *source, *index, *state, *slow;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!O:GradNote", kwlist, &monitor, &source, &index,
                                     &NoteStateType, &state, &slow))
        return NULL;
    GradNoteObject *n = (GradNoteObject *)type->tp_alloc(type, 0);
    if (n == NULL)
        return NULL;
    n->monitor = ref_or_none(monitor);
    n->source = ref_or_none(source);
    n->index = ref_or_none(index);
    n->state = ref_or_none(state);
    n->slow = ref_or_none(slow);
    return (PyObject *)n;
}

static double monotonic_seconds(void) {
#ifdef CLOCK_MONOTONIC
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
    return 0.0;
}

/* 1: noted here; 0: not the armed case, the Python hook decides; -1: an error (set) */
static int grad_note_armed(GradNoteObject *self, PyObject *tensor) {
    NoteStateObject *state = (NoteStateObject *)self->state;
    PyObject *task_obj = PyObject_CallNoArgs(state->task_id);
    if (task_obj == NULL)
        return -1;
    long long task = PyLong_AsLongLong(task_obj);
    Py_DECREF(task_obj);
    if (task == -1 && PyErr_Occurred())
        return -1;
    if (task != state->task)
        return 0;
    /* a second post-accumulate hook may change .grad before the pass ends. The dict this
       hook was put in, where the monitor handed it over, is the one torch calls it from
       (a tensor whose dict is replaced no longer calls this hook); otherwise the tensor's. */
    Py_ssize_t n_hooks;
    if (self->hooks != NULL && PyDict_Check(self->hooks)) {
        n_hooks = PyDict_GET_SIZE(self->hooks);
    } else {
        PyObject *hooks = PyObject_GetAttr(tensor, str_hooks_attr);
        if (hooks == NULL)
            return -1;
        n_hooks = hooks == Py_None ? 0 : PyObject_Size(hooks);
        Py_DECREF(hooks);
        if (n_hooks < 0)
            return -1;
    }
    if (n_hooks > 1)
        return 0;
    if (!PyList_CheckExact(state->pending) || !PyDict_CheckExact(state->passes))
        return 0;
    PyObject *count = PyDict_GetItemWithError(state->passes, self->index); /* borrowed */
    if (count == NULL && PyErr_Occurred())
        return -1;
    long long passes = count == NULL ? 1 : PyLong_AsLongLong(count) + 1;
    if (passes == 0 && PyErr_Occurred())
        return -1;
    PyObject *updated = PyLong_FromLongLong(passes);
    if (updated == NULL)
        return -1;
    int failed = PyDict_SetItem(state->passes, self->index, updated);
    Py_DECREF(updated);
    if (failed < 0)
        return -1;
    if (passes >= state->micro_batches && PyList_Append(state->pending, self->source) < 0)
        return -1;
    return 1;
}

static PyObject *grad_note_call(GradNoteObject *self, PyObject *args, PyObject *kwds) {
    PyObject *active = PyObject_GetAttr(self->monitor, str_active);
    int is_active = active == NULL ? -1 : PyObject_IsTrue(active);
    Py_XDECREF(active);
    if (is_active == 0) /* a step that is not written: nothing to do, as in the Python hook */
        Py_RETURN_NONE;
    if (is_active > 0 && kwds == NULL && PyTuple_GET_SIZE(args) == 1 &&
        ((NoteStateObject *)self->state)->task >= 0) {
        double start = monotonic_seconds();
        int noted = grad_note_armed(self, PyTuple_GET_ITEM(args, 0));
        if (noted > 0) {
            ((NoteStateObject *)self->state)->busy += monotonic_seconds() - start;
            Py_RETURN_NONE;
        }
    }
    /* an error above (reading `active` included) is the Python hook's to meet again, and to
       contain: it must not be left set when the hook is called */
    PyErr_Clear();
    /* slow(source, *args): one Python hook for all parameters */
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *with_source = PyTuple_New(n + 1);
    if (with_source == NULL)
        return NULL;
    Py_INCREF(self->source);
    PyTuple_SET_ITEM(with_source, 0, self->source);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        Py_INCREF(item);
        PyTuple_SET_ITEM(with_source, i + 1, item);
    }
    PyObject *result = PyObject_Call(self->slow, with_source, kwds);
    Py_DECREF(with_source);
    return result;
}

static PyMemberDef grad_note_members[] = {
    {"hooks", T_OBJECT, offsetof(GradNoteObject, hooks), 0,
     "the post-accumulate hook dict of the tensor this hook is in, or None: read instead of the tensor's"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject GradNoteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.GradNote",
    .tp_basicsize = sizeof(GradNoteObject),
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_call = (ternaryfunc)grad_note_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "weight_grad's batched post-accumulate hook, armed case in C (see weight_grad.py).",
    .tp_traverse = (traverseproc)grad_note_traverse,
    .tp_clear = (inquiry)grad_note_clear,
    .tp_members = grad_note_members,
    .tp_new = grad_note_new,
};

static PyObject *str_attached, *str_errors, *str_read, *str_records, *str_busy, *str_report, *str_sums, *str_shape,
    *str_reshape, *str_read_sum, *_one_int;

/* ------------------------------------------------------------------ busy clock
 * BusyClock(): the seconds the extension's hooks spent, as a C double that NodeHook and
 * CallHook add to (monitor.ContainedErrors.busy includes it): adding to the errors' Python
 * attribute costs two attribute calls and a float object a hook call. */
typedef struct {
    PyObject_HEAD
    double seconds;
} BusyClockObject;

static PyMemberDef busy_clock_members[] = {
    {"seconds", T_DOUBLE, offsetof(BusyClockObject, seconds), 0, "seconds counted so far"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BusyClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.BusyClock",
    .tp_basicsize = sizeof(BusyClockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The seconds the extension's hooks spent (monitor.ContainedErrors.clock).",
    .tp_members = busy_clock_members,
    .tp_new = PyType_GenericNew,
};

/* the clock of `errors` (errors.clock) where it is a BusyClock: a new reference; NULL
   (no error set) where it is not */
static PyObject *clock_of(PyObject *errors) {
    PyObject *clock = PyObject_GetAttrString(errors, "clock");
    if (clock == NULL || !Py_IS_TYPE(clock, &BusyClockType)) {
        PyErr_Clear();
        Py_XDECREF(clock);
        return NULL;
    }
    return clock;
}

/* The hook's time counted: on its clock (a BusyClock) where it has one, else errors.busy +=
   seconds, as the Python hooks count theirs. 0, or -1 with the error set. */
static int count_busy(PyObject *clock, PyObject *errors, double seconds) {
    if (clock != NULL) {
        ((BusyClockObject *)clock)->seconds += seconds;
        return 0;
    }
    PyObject *busy = PyObject_GetAttr(errors, str_busy);
    PyObject *more = busy == NULL ? NULL : PyFloat_FromDouble(seconds);
    PyObject *total = more == NULL ? NULL : PyNumber_InPlaceAdd(busy, more);
    int failed = total == NULL || PyObject_SetAttr(errors, str_busy, total) < 0;
    Py_XDECREF(busy);
    Py_XDECREF(more);
    Py_XDECREF(total);
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ node hooks
 * NodeHook(monitor, site, scope, kind): module.py's _NodeHook (its docstring says what it
 * does), in C. The Python code reads and sets its kind, outs, ins, pre and post as it does
 * _NodeHook's. A call, hook(grads) as a pre-hook or hook(grad_inputs, grad_outputs) as a
 * post-hook, runs as a call of _NodeHook (ContainedHook.__call__, then its run) runs:
 * nothing while the monitor is not active; the time counted (count_busy); each
 * slot's error reported once per slot site through
 * monitor.errors.report(site, exc), one outside the slots under `site`; an exception that
 * is not an Exception (KeyboardInterrupt) goes on. A grad_input slot with a sum number adds
 * its part to the running sum as monitor._add_part(number, parts, vpp, name, grad) does
 * (add_part, in C). Not tracked by the
 * collector (one is made per hooked node per written step), it holds its monitor by a
 * weak reference and so sits in no cycle (the monitor's node tables hold the hooks); a
 * hook whose monitor is gone does nothing. */
typedef struct {
    PyObject_HEAD
    PyObject *monitor; /* weakref.ref to the ModuleMonitor */
    PyObject *site, *scope, *kind, *outs, *ins;
    PyObject *clock; /* the errors' BusyClock, or NULL: errors.busy */
    char pre, post;
} NodeHookObject;

static PyObject *referent(PyObject *ref);


static void node_hook_dealloc(NodeHookObject *self) {
    Py_XDECREF(self->monitor);
    Py_XDECREF(self->site);
    Py_XDECREF(self->scope);
    Py_XDECREF(self->kind);
    Py_XDECREF(self->outs);
    Py_XDECREF(self->ins);
    Py_XDECREF(self->clock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A new NodeHook of the monitor held by the weak reference `monitor_ref`, for a node of
   type `kind`, its slots empty; `clock` a BusyClock or NULL */
static PyObject *node_hook_made(PyTypeObject *type, PyObject *monitor_ref, PyObject *site, PyObject *scope,
                                PyObject *kind, PyObject *clock) {
    NodeHookObject *h = (NodeHookObject *)type->tp_alloc(type, 0);
    PyObject *empty = h == NULL ? NULL : PyTuple_New(0);
    if (empty == NULL) {
        Py_XDECREF(h);
        return NULL;
    }
    h->monitor = ref_or_none(monitor_ref);
    h->site = ref_or_none(site);
    h->scope = ref_or_none(scope);
    h->kind = ref_or_none(kind);
    h->ins = ref_or_none(empty);
    h->outs = empty; /* the new reference */
    Py_XINCREF(clock);
    h->clock = clock;
    return (PyObject *)h;
}

static PyObject *node_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor", "site", "scope", "kind", "clock", NULL};
    PyObject *monitor, *site, *scope, *kind, *clock = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OUUO|O:NodeHook", kwlist, &monitor, &site, &scope, &kind, &clock))
        return NULL;
    if (clock == Py_None)
        clock = NULL;
    if (clock != NULL && !Py_IS_TYPE(clock, &BusyClockType)) {
        PyErr_SetString(PyExc_TypeError, "NodeHook: clock must be a BusyClock or None");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(monitor, NULL);
    if (ref == NULL)
        return NULL;
    PyObject *h = node_hook_made(type, ref, site, scope, kind, clock);
    Py_DECREF(ref);
    return h;
}

/* Report the raised Exception through errors.report(site, exc) and clear it: 0; -1 where
   it is not an Exception, or the report raised (left set) */
static int node_hook_contain(PyObject *errors, PyObject *site) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *result = value == NULL ? NULL : PyObject_CallMethodObjArgs(errors, str_report, site, value, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* monitor.<read_name>(t, vpp, name, scope) (`call_args`), its record appended to
   monitor._records: 0, or -1 with the error set */
static int read_into(PyObject *monitor, PyObject *read_name, PyObject *const call_args[4]) {
    PyObject *read = PyObject_GetAttr(monitor, read_name);
    PyObject *rec = read == NULL ? NULL : PyObject_Vectorcall(read, call_args, 4, NULL);
    PyObject *records = rec == NULL ? NULL : PyObject_GetAttr(monitor, str_records);
    int failed = records == NULL || !PyList_Check(records) || PyList_Append(records, rec) < 0;
    if (records != NULL && !PyList_Check(records))
        PyErr_SetString(PyExc_TypeError, "monitor._records is not a list");
    Py_XDECREF(read);
    Py_XDECREF(rec);
    Py_XDECREF(records);
    return failed ? -1 : 0;
}

/* ModuleMonitor._add_part(number, parts, vpp, name, g) of a grad_input slot (vpp, e, name,
   number, parts, site): the part added to the running sum in monitor._sums (a list
   [expected, count, total, vpp, name]), the sum read with monitor._read_sum and its record
   appended to monitor._records when its last part is in. 0, or -1 with the error set. */
static int add_part(PyObject *monitor, PyObject *scope, PyObject *slot, PyObject *g) {
    PyObject *number = PyTuple_GET_ITEM(slot, 3);
    PyObject *sums = PyObject_GetAttr(monitor, str_sums);
    if (sums == NULL)
        return -1;
    int result = -1;
    PyObject *acc = PyDict_Check(sums) ? PyDict_GetItemWithError(sums, number) : NULL; /* borrowed */
    PyObject *held = NULL; /* acc, held while _sum_parts runs Python code */
    if (!PyDict_Check(sums)) {
        PyErr_SetString(PyExc_TypeError, "NodeHook: monitor._sums is not a dict");
        goto done;
    }
    if (acc == NULL) {
        if (PyErr_Occurred())
            goto done;
        PyObject *one = PyLong_FromLong(1);
        PyObject *made = one == NULL ? NULL : PyList_New(5);
        if (made == NULL) {
            Py_XDECREF(one);
            goto done;
        }
        PyObject *items[5] = {PyTuple_GET_ITEM(slot, 4), one, g, PyTuple_GET_ITEM(slot, 0), PyTuple_GET_ITEM(slot, 2)};
        for (int i = 0; i < 5; i++)
            PyList_SET_ITEM(made, i, Py_NewRef(items[i]));
        Py_DECREF(one);
        int failed = PyDict_SetItem(sums, number, made);
        acc = made;
        Py_DECREF(made); /* the dict holds it */
        if (failed < 0)
            goto done;
    } else {
        if (!PyList_CheckExact(acc) || PyList_GET_SIZE(acc) != 5) {
            PyErr_SetString(PyExc_TypeError, "NodeHook: a running sum is not a list of 5");
            goto done;
        }
        /* monitor._sum_parts(total, g): the engine's sum (a part through a view's node
           reshaped to its base's), run outside the training's dispatch modes */
        static PyObject *str_sum_parts = NULL;
        if (str_sum_parts == NULL && (str_sum_parts = PyUnicode_InternFromString("_sum_parts")) == NULL)
            goto done;
        held = Py_NewRef(acc);
        PyObject *total = Py_NewRef(PyList_GET_ITEM(acc, 2));
        PyObject *sum = PyObject_CallMethodObjArgs(monitor, str_sum_parts, total, g, NULL);
        Py_DECREF(total);
        if (sum == NULL)
            goto done;
        PyList_SetItem(acc, 2, sum); /* steals sum */
        PyObject *count = PyNumber_Add(PyList_GET_ITEM(acc, 1), _one_int);
        if (count == NULL)
            goto done;
        PyList_SetItem(acc, 1, count);
    }
    int complete = PyObject_RichCompareBool(PyList_GET_ITEM(acc, 1), PyList_GET_ITEM(acc, 0), Py_EQ);
    if (complete < 0)
        goto done;
    if (complete) { /* ModuleMonitor._flush(number) */
        Py_INCREF(acc);
        PyObject *call_args[4] = {PyList_GET_ITEM(acc, 2), PyList_GET_ITEM(acc, 3), PyList_GET_ITEM(acc, 4), scope};
        int failed = PyDict_DelItem(sums, number) < 0 || read_into(monitor, str_read_sum, call_args) < 0;
        Py_DECREF(acc);
        if (failed)
            goto done;
    }
    result = 0;
done:
    Py_XDECREF(held);
    Py_DECREF(sums);
    return result;
}

/* One slot: slot[0] is the vpp stage, slot[1] the gradient's index in grads, slot[2] the
   row name; the record appended to records (or the part added to its running sum,
   add_part). 0, or -1 with the error set. */
static int node_hook_record(NodeHookObject *self, PyObject *read, PyObject *records, PyObject *slot,
                            PyObject *grads, PyObject *monitor) {
    Py_ssize_t size = PyTuple_GET_SIZE(slot);
    Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(slot, 1));
    if (at == -1 && PyErr_Occurred())
        return -1;
    PyObject *g = PySequence_GetItem(grads, at);
    if (g == NULL)
        return -1;
    int failed = 0;
    if (g != Py_None) {
        if (size == 6) { /* a grad_input slot: (vpp, e, name, number, parts, site) */
            long number = PyLong_AsLong(PyTuple_GET_ITEM(slot, 3));
            if (number == -1 && PyErr_Occurred()) {
                failed = 1;
            } else if (number >= 0) {
                failed = add_part(monitor, self->scope, slot, g) < 0;
                Py_DECREF(g);
                return failed ? -1 : 0;
            }
        }
        if (!failed) {
            PyObject *call_args[4] = {g, PyTuple_GET_ITEM(slot, 0), PyTuple_GET_ITEM(slot, 2), self->scope};
            PyObject *rec = PyObject_Vectorcall(read, call_args, 4, NULL);
            failed = rec == NULL || PyList_Append(records, rec) < 0;
            Py_XDECREF(rec);
        }
    }
    Py_DECREF(g);
    return failed ? -1 : 0;
}

/* Every slot of `slots` (a tuple of tuples whose last item is the slot's site) recorded
   from `grads`, each slot's error contained. 0, or -1 with an error that is not to be
   contained (set). */
static int node_hook_slots(NodeHookObject *self, PyObject *slots, PyObject *grads, PyObject *monitor,
                           PyObject *errors, PyObject **read_fn, PyObject **records_list) {
    if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) == 0)
        return 0;
    if (*records_list == NULL) { /* monitor._read and monitor._records, once a call */
        if (*read_fn == NULL && (*read_fn = PyObject_GetAttr(monitor, str_read)) == NULL)
            return -2; /* an error outside the slots */
        PyObject *found = PyObject_GetAttr(monitor, str_records);
        if (found == NULL || !PyList_Check(found)) {
            if (found != NULL)
                PyErr_SetString(PyExc_TypeError, "NodeHook: monitor._records is not a list");
            Py_XDECREF(found);
            return -2;
        }
        *records_list = found;
    }
    PyObject *read = *read_fn, *records = *records_list;
    int result = 0;
    Py_INCREF(slots); /* a slot's Python code may replace the hook's tuple */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); i++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, i);
        if (!PyTuple_Check(slot) || (PyTuple_GET_SIZE(slot) != 4 && PyTuple_GET_SIZE(slot) != 6)) {
            PyErr_SetString(PyExc_TypeError, "NodeHook: a slot is not a tuple of 4 or 6 items");
            result = -2;
            break;
        }
        if (node_hook_record(self, read, records, slot, grads, monitor) < 0 &&
            node_hook_contain(errors, PyTuple_GET_ITEM(slot, PyTuple_GET_SIZE(slot) - 1)) < 0) {
            result = -1;
            break;
        }
    }
    Py_DECREF(slots);
    return result;
}

static PyObject *node_hook_call(NodeHookObject *self, PyObject *args, PyObject *kwds) {
    if (kwds != NULL || !PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1 || PyTuple_GET_SIZE(args) > 2) {
        PyErr_SetString(PyExc_TypeError, "NodeHook(grads) or NodeHook(grad_inputs, grad_outputs)");
        return NULL;
    }
    PyObject *monitor = referent(self->monitor);
    if (monitor == NULL) /* the monitor is gone */
        Py_RETURN_NONE;
    PyObject *active = PyObject_GetAttr(monitor, str_active);
    int is_active = active == NULL ? -1 : PyObject_IsTrue(active);
    Py_XDECREF(active);
    if (is_active <= 0) {
        Py_DECREF(monitor);
        if (is_active < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *errors = PyObject_GetAttr(monitor, str_errors);
    if (errors == NULL) {
        Py_DECREF(monitor);
        return NULL;
    }
    double start = monotonic_seconds();
    int failed = 0; /* -1: to be contained under self->site; -2: not to be contained */
    PyObject *attached = PyObject_GetAttr(monitor, str_attached);
    int is_attached = attached == NULL ? -1 : PyObject_IsTrue(attached);
    Py_XDECREF(attached);
    if (is_attached < 0) {
        failed = -1;
    } else if (is_attached) {
        PyObject *grads = PyTuple_GET_ITEM(args, 0), *read = NULL, *records = NULL;
        int r = 0;
        if (PyTuple_GET_SIZE(args) == 1) { /* the pre-hook: grads are the node's incoming gradients */
            r = node_hook_slots(self, self->outs, grads, monitor, errors, &read, &records);
        } else {
            if (!self->pre)
                r = node_hook_slots(self, self->outs, PyTuple_GET_ITEM(args, 1), monitor, errors, &read, &records);
            if (r == 0)
                r = node_hook_slots(self, self->ins, grads, monitor, errors, &read, &records);
        }
        Py_XDECREF(read);
        Py_XDECREF(records);
        failed = r == 0 ? 0 : r == -2 ? -1 : -2;
    }
    if (failed == -1 && node_hook_contain(errors, self->site) < 0)
        failed = -2;
    PyObject *result = NULL;
    if ((failed == 0 || failed == -1) && count_busy(self->clock, errors, monotonic_seconds() - start) == 0)
        result = none_ref();
    Py_DECREF(errors);
    Py_DECREF(monitor);
    return result;
}

static PyObject *node_hook_monitor(NodeHookObject *self, void *closure) {
    PyObject *monitor = referent(self->monitor);
    if (monitor == NULL)
        Py_RETURN_NONE;
    return monitor;
}

static PyGetSetDef node_hook_getset[] = {
    {"monitor", (getter)node_hook_monitor, NULL, "the monitor, or None once it is gone", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef node_hook_members[] = {
    {"site", T_OBJECT, offsetof(NodeHookObject, site), READONLY, NULL},
    {"kind", T_OBJECT, offsetof(NodeHookObject, kind), READONLY, "the type of the node it is made for"},
    {"outs", T_OBJECT_EX, offsetof(NodeHookObject, outs), 0, "the grad_output slots"},
    {"ins", T_OBJECT_EX, offsetof(NodeHookObject, ins), 0, "the grad_input slots"},
    {"pre", T_BOOL, offsetof(NodeHookObject, pre), 0, "registered as a pre-hook"},
    {"post", T_BOOL, offsetof(NodeHookObject, post), 0, "registered as a post-hook"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject NodeHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.NodeHook",
    .tp_basicsize = sizeof(NodeHookObject),
    .tp_dealloc = (destructor)node_hook_dealloc,
    .tp_call = (ternaryfunc)node_hook_call,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* not collected: see above */
    .tp_doc = "module.py's _NodeHook in C: the module monitor's hooks on one autograd node.",
    .tp_members = node_hook_members,
    .tp_getset = node_hook_getset,
    .tp_new = node_hook_new,
};

/* cache_entry(tensor, version, record) -> (weakref.ref(tensor), version, record), the entry
   of the engines' same-tensor cache, with the weak reference and the tuple outside the
   garbage collector: an entry lives from a module's hook to the end of the step (one per
   activation and gradient observed), and a weak reference without a callback, like a
   tuple of such objects and a record, holds nothing the collector could free. */
static PyObject *py_cache_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "cache_entry(tensor, version, record)");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(args[0], NULL);
    if (ref == NULL)
        return NULL;
    PyObject *entry = PyTuple_Pack(3, ref, args[1], args[2]);
    Py_DECREF(ref);
    if (entry == NULL)
        return NULL;
    if (Py_IS_TYPE(args[2], &RecordType) && !PyObject_GC_IsTracked(args[1])) {
        PyObject_GC_UnTrack(ref);
        PyObject_GC_UnTrack(entry);
    }
    return entry;
}

/* ------------------------------------------------------------------ tensor_record
 * The engine's record() of a tensor the kernel reads (TorchStatsEngine._native_buffer's
 * checks, then _record_read's cache and read), in one call: every module activation and
 * gradient of a written step comes through here, and in Python its dozen attribute reads
 * and three calls cost about as much as the statistics of a small tensor. Anything it
 * does not take (another tensor type, device, dtype, layout; an error while looking)
 * returns None, and the engine's Python path decides, raises or reads. */

static PyObject *str_is_cpu, *str_dtype, *str_layout, *str_is_nested, *str_is_contiguous, *str_is_neg, *str_numel,
    *str_data_ptr, *str_is_inference, *str_version;

/* 1 true, 0 false, -1 error: an attribute's truth */
static int attr_truth(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth;
}

/* 1 true, 0 false, -1 error: a method's result's truth (no arguments) */
static int call_truth(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (v == NULL)
        return -1;
    int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth;
}

/* t.is_neg(): 1, 0, or -1 on an error. The method of the tensor's type is called directly
   (a plain tensor's type is torch's, and a tensor's own attributes do not change its
   negative bit): looking it up through the instance costs a third of the call. */
static int neg_bit(PyObject *t) {
    PyObject *method = _PyType_Lookup(Py_TYPE(t), str_is_neg); /* borrowed */
    if (method == NULL || !Py_IS_TYPE(method, &PyMethodDescr_Type))
        return call_truth(t, str_is_neg);
    PyObject *v = PyObject_Vectorcall(method, &t, 1, NULL);
    if (v == NULL)
        return -1;
    int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth;
}

/* DLPack's C ABI (dlpack.h): the unversioned DLManagedTensor that every version of the
   standard keeps, in a capsule named "dltensor". */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device_t;
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype_t;
typedef struct {
    void *data;
    dl_device_t device;
    int32_t ndim;
    dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: compact, row-major */
    uint64_t byte_offset;
} dl_tensor_t;
typedef struct dl_managed {
    dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *);
} dl_managed_t;
enum { DL_CPU = 1, DL_FLOAT = 2, DL_BFLOAT = 4 };

/* torch._C._to_dlpack where use_exporter() was given it (after the engine checked that it
   reads what the tensor's own getters say), else NULL: one call for the address, dtype,
   device, shape and strides instead of seven getters, each of which costs about as much
   as the call (every getter sets up torch's error and warning handling). */
static PyObject *dl_export = NULL;

/* What the kernel reads of a described tensor: 1 with its first element's address, its
   element count and the dtype code, where it is a CPU tensor of a dtype the kernel reduces,
   contiguous and not empty; else 0. */
static int described_buffer(const dl_tensor_t *d, void **ptr, int64_t *n, int *code) {
    int mask = msprobe_stats_dtypes(), ok = d->device.device_type == DL_CPU && d->dtype.lanes == 1 && d->ndim >= 0;
    if (ok) {
        if (d->dtype.code == DL_FLOAT && d->dtype.bits == 32)
            *code = F32;
        else if (d->dtype.code == DL_BFLOAT && d->dtype.bits == 16)
            *code = BF16;
        else if (d->dtype.code == DL_FLOAT && d->dtype.bits == 16)
            *code = F16;
        else
            ok = 0;
        ok = ok && (mask & (1 << *code));
    }
    int64_t count = 1, expected = 1;
    for (int32_t k = d->ndim - 1; ok && k >= 0; k--) { /* torch's is_contiguous: size-1 dims have any stride */
        int64_t size = d->shape[k];
        count *= size;
        if (size != 1 && d->strides != NULL && d->strides[k] != expected)
            ok = 0;
        expected *= size;
    }
    void *data = ok ? (char *)d->data + d->byte_offset : NULL;
    if (!ok || count <= 0 || data == NULL)
        return 0;
    *ptr = data;
    *n = count;
    return 1;
}

/* described_buffer's result where `t` has no negative bit (which DLPack does not carry:
   the memory of a tensor with it holds the negated values): 1, 0, or -1 on an error. */
static int unnegated(int described, PyObject *t) {
    if (described <= 0)
        return described;
    int neg = neg_bit(t);
    return neg != 0 ? (neg < 0 ? -1 : 0) : 1;
}

/* kernel_buffer through `export` (dl_export, or the one py_exported checks): 1 with the
   buffer, 0 where the kernel does not read the tensor (or the exporter refuses it: no
   storage, nested, quantized, meta), -1 on an error (set). The capsule's tensor is a second
   reference to `t`'s memory, released here: `t` itself, alive in the caller, keeps the
   memory. */
static int exported_buffer(PyObject *export, PyObject *t, void **ptr, int64_t *n, int *code) {
    PyObject *capsule = PyObject_CallOneArg(export, t);
    if (capsule == NULL) {
        PyErr_Clear(); /* the Python path looks again, and says what is wrong */
        return 0;
    }
    dl_managed_t *m = (dl_managed_t *)PyCapsule_GetPointer(capsule, "dltensor");
    if (m == NULL) {
        PyErr_Clear();
        Py_DECREF(capsule);
        return 0;
    }
    int ok = described_buffer(&m->dl_tensor, ptr, n, code);
    Py_DECREF(capsule); /* its deleter drops the export's reference */
    return unnegated(ok, t);
}

/* DLPack's C exchange API (dlpack.h, version 1.x): a table of C functions that the tensor
   type publishes as `__dlpack_c_exchange_api__`. Its dltensor_from_py_object_no_sync
   fills a DLTensor on the caller's stack that views the tensor's own sizes, strides and
   memory while the tensor lives: no Python call, no capsule, no allocation, no stream
   sync (about a tenth of _to_dlpack's cost). It is used where use_view() was given the
   table (after the engine checked that it reads what the getters say); it is called with
   the GIL held, and fails with a Python error set (torch: RuntimeError) on a tensor it
   cannot describe. */
typedef int (*dl_view_fn)(void *py_object, dl_tensor_t *out);
typedef struct dl_api_header {
    uint32_t major, minor;
    struct dl_api_header *prev_api;
} dl_api_header_t;
typedef struct {
    dl_api_header_t header;
    void *managed_tensor_allocator, *managed_tensor_from_py_object_no_sync, *managed_tensor_to_py_object_no_sync;
    dl_view_fn dltensor_from_py_object_no_sync;
    void *current_work_stream;
} dl_exchange_api_t;
static dl_view_fn dl_view = NULL;
static PyObject *dl_view_api = NULL; /* the capsule, held while its function is used */

/* exported_buffer's results through the view, or VIEW_REFUSED where torch could not
   describe the tensor (no storage, sparse or nested, quantized, meta, a device DLPack has
   no code for). torch reports that through a C++ exception whose message it formats with
   its backtrace: about a millisecond a tensor, against 12 us for _to_dlpack's refusal. */
#define VIEW_REFUSED (-2)
static int viewed_buffer(dl_view_fn view, PyObject *t, void **ptr, int64_t *n, int *code) {
    dl_tensor_t d;
    memset(&d, 0, sizeof d);
    if (view(t, &d) != 0) {
        PyErr_Clear(); /* the Python path looks again, and says what is wrong */
        return VIEW_REFUSED;
    }
    return unnegated(described_buffer(&d, ptr, n, code), t);
}

/* use_view(capsule or None): read tensors through the exchange API's view from now on (a
   capsule named "dlpack_exchange_api" of DLPack 1.x with that function), or not. */
static PyObject *py_use_view(PyObject *self, PyObject *capsule) {
    if (capsule == Py_None) {
        dl_view = NULL;
        Py_CLEAR(dl_view_api);
        Py_RETURN_NONE;
    }
    const dl_api_header_t *h = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (h == NULL)
        return NULL;
    while (h != NULL && h->major != 1) /* an API of a newer major version may chain an older one */
        h = h->prev_api;
    const dl_exchange_api_t *api = (const dl_exchange_api_t *)h;
    if (api == NULL || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_SetString(PyExc_ValueError, "use_view: no DLPack 1.x exchange API with dltensor_from_py_object_no_sync");
        return NULL;
    }
    Py_INCREF(capsule);
    Py_XSETREF(dl_view_api, capsule);
    dl_view = api->dltensor_from_py_object_no_sync;
    Py_RETURN_NONE;
}

/* view() -> the exchange API in use (its capsule), or None */
static PyObject *py_view(PyObject *self, PyObject *unused) {
    return ref_or_none(dl_view_api);
}

/* viewed(t) -> (address, count, code) or None: what the view in use gives for `t` (for
   the engine's check after use_view) */
static PyObject *py_viewed(PyObject *self, PyObject *t) {
    if (dl_view == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "viewed: no view in use (use_view)");
        return NULL;
    }
    void *ptr = NULL;
    int64_t n = 0;
    int code = 0;
    int ok = viewed_buffer(dl_view, t, &ptr, &n, &code);
    if (ok == -1)
        return NULL;
    if (ok <= 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(NLi)", PyLong_FromVoidPtr(ptr), (long long)n, code);
}

/* use_exporter(fn or None): read tensors through fn (torch._C._to_dlpack) from now on, or
   through their getters again. */
static PyObject *py_use_exporter(PyObject *self, PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "use_exporter: a callable or None");
        return NULL;
    }
    if (fn != Py_None)
        Py_INCREF(fn);
    Py_XSETREF(dl_export, fn == Py_None ? NULL : fn);
    Py_RETURN_NONE;
}

/* exporter() -> the exporter in use, or None */
static PyObject *py_exporter(PyObject *self, PyObject *unused) {
    return ref_or_none(dl_export);
}

/* exported(t, fn) -> (address, count, code) or None: what the exporter fn gives for `t`
   (for the engine's check before use_exporter). */
static PyObject *py_exported(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "exported takes 2 arguments");
        return NULL;
    }
    void *ptr = NULL;
    int64_t n = 0;
    int code = 0;
    int ok = exported_buffer(args[1], args[0], &ptr, &n, &code);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(NLi)", PyLong_FromVoidPtr(ptr), (long long)n, code);
}

/* Whether the NodeHook `hook` reads index i of the gradients a call gives it (which: 0 a
   pre-hook's incoming gradients, 1 a post-hook's results, 2 a post-hook's incoming
   gradients): its slots' indices (node_hook_record reads item 1 of each). The C++ graph
   hooks wrap only those in tensors. 1 for any other hook, or a slot it cannot read. */
static int node_hook_reads(PyObject *hook, int which, Py_ssize_t i) {
    if (Py_TYPE(hook) != &NodeHookType)
        return 1;
    NodeHookObject *h = (NodeHookObject *)hook;
    if (which == 2 && h->pre) /* its pre-hook read the outs */
        return 0;
    PyObject *slots = which == 1 ? h->ins : h->outs;
    if (!PyTuple_Check(slots))
        return 1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(slots); k++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, k);
        if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) < 2)
            return 1;
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(slot, 1));
        if (at == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (at == i)
            return 1;
    }
    return 0;
}

/* The C++ graph hooks' C API (frameworks/pytorch/graph_hooks.cpp, GraphCApi: the same
   layout), or NULL. A node is an opaque pointer valid during one forward hook (see there);
   `edge` handles are owned and released. Set with graph_api(); kept once set, so that a
   call state made while it was on can release its handle after it is switched off. */
typedef struct {
    unsigned int version;
    void (*set_reads)(int (*reads)(PyObject *hook, int which, Py_ssize_t i));
    void *(*edge_of)(PyObject *tensor, long long *nr);
    void (*release)(void *handle);
    int (*describe)(const void *node, unsigned long long *seq, PyObject **kind, const void **raw);
    int (*walk)(const void *const *roots, size_t n_roots, const void *target, long long target_nr,
                long long boundary, int (*found)(void *ctx, const void *node, Py_ssize_t e), void *ctx);
    int (*put)(const void *node, PyObject *hook, int post);
    PyObject *(*as_object)(const void *node);
    int (*buffer)(PyObject *tensor, void **ptr, int64_t *n, int *code);
} msprobe_graph_capi_t;
static const msprobe_graph_capi_t *graph_capi = NULL;
static int graph_capi_on = 0;

/* The tensor's data pointer, element count and dtype (a new reference) where the kernel
   reads it: 1; 0 where it does not; -1 on an error (set). */
static int kernel_buffer(PyObject *t, PyObject *plain_types, PyObject *codes, PyObject *strided, void **ptr,
                         int64_t *n, int *code, PyObject **dtype) {
    *dtype = NULL;
    int plain = PySet_Contains(plain_types, (PyObject *)Py_TYPE(t));
    if (plain <= 0)
        return plain;
    /* The C++ graph hooks' library reads the tensor itself (checked against the getters
       when it is loaded): a CPU tensor the kernel reads is described in a few
       instructions; any other goes the ways below. */
    if (graph_capi_on && graph_capi->buffer(t, ptr, n, code) && (msprobe_stats_dtypes() & (1 << *code)))
        return 1;
    /* The view says the device (is_cpu costs as much again): a tensor on an accelerator is
       described without a copy or a sync, and left to the Python path. *dtype stays NULL
       on the view's and the export's paths: cached_record asks where it needs it. */
    if (dl_view != NULL) {
        int viewed = viewed_buffer(dl_view, t, ptr, n, code);
        if (viewed != VIEW_REFUSED)
            return viewed;
        /* A model that has one such tensor has it at every step (a sparse gradient, a
           tensor on a device DLPack has no code for): the view is given up for good, and
           this tensor and every later one go the export's or the getters' way, which turn
           such tensors away cheaply. */
        dl_view = NULL;
        Py_CLEAR(dl_view_api);
    }
    int yes = attr_truth(t, str_is_cpu);
    if (yes <= 0)
        return yes;
    if (dl_export != NULL)
        return exported_buffer(dl_export, t, ptr, n, code);
    PyObject *dt = PyObject_GetAttr(t, str_dtype);
    if (dt == NULL)
        return -1;
    PyObject *code_obj = PyDict_GetItemWithError(codes, dt); /* borrowed */
    if (code_obj == NULL) {
        Py_DECREF(dt);
        return PyErr_Occurred() ? -1 : 0;
    }
    *code = (int)PyLong_AsLong(code_obj);
    if (*code == -1 && PyErr_Occurred()) {
        Py_DECREF(dt);
        return -1;
    }
    *dtype = dt;
    PyObject *layout = PyObject_GetAttr(t, str_layout);
    if (layout == NULL)
        return -1;
    Py_DECREF(layout); /* compared by identity only: the object stays alive in torch */
    if (layout != strided)
        return 0;
    if ((yes = attr_truth(t, str_is_nested)) != 0)
        return yes < 0 ? -1 : 0;
    if ((yes = call_truth(t, str_is_contiguous)) <= 0)
        return yes;
    if ((yes = neg_bit(t)) != 0)
        return yes < 0 ? -1 : 0;
    PyObject *count = PyObject_CallMethodNoArgs(t, str_numel);
    if (count == NULL)
        return -1;
    *n = PyLong_AsLongLong(count);
    Py_DECREF(count);
    if (*n == -1 && PyErr_Occurred())
        return -1;
    if (*n <= 0)
        return 0;
    PyObject *pointer = PyObject_CallMethodNoArgs(t, str_data_ptr);
    if (pointer == NULL)
        return -1; /* a storage-less wrapper that looks like a plain tensor: RuntimeError */
    *ptr = PyLong_AsVoidPtr(pointer);
    Py_DECREF(pointer);
    if (*ptr == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return 1;
}

/* t._version == version (an int object): 1, 0, or -1 on an error */
static int version_is(PyObject *t, PyObject *version) {
    PyObject *v = PyObject_GetAttr(t, str_version);
    if (v == NULL)
        return -1;
    int same = PyObject_RichCompareBool(v, version, Py_EQ);
    Py_DECREF(v);
    return same;
}

/* A weak reference's object (a new reference), or NULL, no error set, where it is dead. */
static PyObject *referent(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) < 0)
        PyErr_Clear();
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref); /* borrowed */
    if (obj == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (obj == Py_None)
        return NULL;
    Py_INCREF(obj);
    return obj;
#endif
}

/* The cache's record for this buffer where the tensor first seen there is alive and
   unchanged, at the same address, of the same dtype and count, and `t` is unchanged too
   (`t_version`: its version, read by the caller; a borrowed reference; NULL with no error
   where there is none). */
static PyObject *cached_record(PyObject *entry, PyObject *t, void *ptr, int64_t n, PyObject *dtype,
                               PyObject *t_version) {
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3 ||
        !PyWeakref_CheckRef(PyTuple_GET_ITEM(entry, 0)) || !Py_IS_TYPE(PyTuple_GET_ITEM(entry, 2), &RecordType))
        return NULL;
    RecordObject *rec = (RecordObject *)PyTuple_GET_ITEM(entry, 2);
    if (rec->numel == NULL || PyLong_AsLongLong(rec->numel) != n) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *first = referent(PyTuple_GET_ITEM(entry, 0));
    if (first == NULL)
        return NULL;
    PyObject *version = PyTuple_GET_ITEM(entry, 1), *result = NULL;
    PyObject *first_dtype = NULL, *first_ptr = NULL, *own_dtype = NULL;
    int same = PyObject_RichCompareBool(t_version, version, Py_EQ);
    if (same != 1)
        goto done;
    if (first == t) {
        /* the tensor first seen here, unchanged: its dtype and address are the ones just read */
        result = (PyObject *)rec;
        goto done;
    }
    if (version_is(first, version) != 1)
        goto done;
    if (dtype == NULL && (dtype = own_dtype = PyObject_GetAttr(t, str_dtype)) == NULL)
        goto done; /* read through the exporter, which gives no dtype object */
    if ((first_dtype = PyObject_GetAttr(first, str_dtype)) == NULL || first_dtype != dtype)
        goto done;
    if ((first_ptr = PyObject_CallMethodNoArgs(first, str_data_ptr)) == NULL || PyLong_AsVoidPtr(first_ptr) != ptr)
        goto done;
    result = (PyObject *)rec;
done:
    Py_XDECREF(first_dtype);
    Py_XDECREF(first_ptr);
    Py_XDECREF(own_dtype);
    Py_DECREF(first);
    PyErr_Clear(); /* a failed check is a miss: the tensor is read */
    return result;
}

/* tensor_record(t, plain_types, codes, strided, threads, nans, zeros, vpp_stage, name,
   scope, micro_step, cache) -> Record or None. `cache`: a dict (first element's address ->
   cache_entry) or None. */
static PyObject *py_tensor_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "tensor_record takes 12 arguments");
        return NULL;
    }
    PyObject *t = args[0], *cache = args[11], *dtype = NULL, *key = NULL, *version = NULL;
    void *ptr = NULL;
    int64_t n = 0;
    int code = 0;
    if (!PyAnySet_Check(args[1]) || !PyDict_Check(args[2]) || (cache != Py_None && !PyDict_Check(cache))) {
        PyErr_SetString(PyExc_TypeError, "tensor_record: plain_types a set, codes and cache dicts");
        return NULL;
    }
    int ok = kernel_buffer(t, args[1], args[2], args[3], &ptr, &n, &code, &dtype);
    if (ok <= 0) {
        Py_XDECREF(dtype);
        PyErr_Clear(); /* the Python path looks again, and says what is wrong */
        Py_RETURN_NONE;
    }
    int threads = (int)PyLong_AsLong(args[4]);
    int want_nans = PyObject_IsTrue(args[5]), want_zeros = PyObject_IsTrue(args[6]);
    if ((threads == -1 && PyErr_Occurred()) || want_nans < 0 || want_zeros < 0)
        goto fail;
    if (cache != Py_None) {
        /* An inference tensor has no version counter (reading it raises): never cached. The
           one read of the version serves the lookup and the entry. */
        version = PyObject_GetAttr(t, str_version);
        if (version == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
                goto fail;
            PyErr_Clear();
            int inference = call_truth(t, str_is_inference);
            if (inference < 0)
                goto fail;
            if (!inference) {
                PyErr_SetString(PyExc_RuntimeError, "tensor_record: a tensor without a version counter");
                goto fail;
            }
            cache = Py_None;
        } else {
            if ((key = PyLong_FromVoidPtr(ptr)) == NULL)
                goto fail;
            PyObject *entry = PyDict_GetItemWithError(cache, key); /* borrowed */
            if (entry == NULL && PyErr_Occurred())
                goto fail;
            PyObject *hit = entry == NULL ? NULL : cached_record(entry, t, ptr, n, dtype, version);
            if (hit != NULL) {
                PyObject *relabel[4] = {args[7], args[8], args[9], args[10]};
                PyObject *out = record_relabelled((RecordObject *)hit, relabel, 4);
                Py_DECREF(key);
                Py_DECREF(version);
                Py_XDECREF(dtype);
                return out;
            }
        }
    }
    double out[4];
    int64_t zeros = 0;
    int64_t nans = run_stats(ptr, n, code, threads, out, want_zeros ? &zeros : NULL);
    RecordObject *r = record_alloc();
    if (r == NULL)
        goto fail;
    SET_REF(r->vpp_stage, args[7]);
    SET_REF(r->name, args[8]);
    SET_REF(r->scope, args[9]);
    SET_REF(r->micro_step, args[10]);
    r->numel = PyLong_FromLongLong(n);
    r->nans = want_nans ? PyLong_FromLongLong(nans) : none_ref();
    r->zeros = want_zeros ? PyLong_FromLongLong(zeros) : none_ref();
    if (r->numel == NULL || r->nans == NULL || r->zeros == NULL) {
        Py_DECREF(r);
        goto fail;
    }
    set_inline((PyObject *)r, out, nans);
    if (cache != Py_None) {
        PyObject *pass[3] = {t, version, (PyObject *)r};
        PyObject *entry = py_cache_entry(NULL, pass, 3);
        if (entry == NULL) {
            PyErr_Clear(); /* a tensor subclass without weak references: no caching */
        } else {
            int stored = PyDict_SetItem(cache, key, entry);
            Py_DECREF(entry);
            if (stored < 0) {
                Py_DECREF(r);
                goto fail;
            }
        }
    }
    Py_XDECREF(key);
    Py_XDECREF(version);
    Py_XDECREF(dtype);
    return (PyObject *)r;
fail:
    Py_XDECREF(key);
    Py_XDECREF(version);
    Py_XDECREF(dtype);
    return NULL;
}

/* ------------------------------------------------------------------ module call hooks
 * CallHook(monitor, fallback, site, vpp, names, key, row, post): the module monitor's
 * forward pre-hook (post false) or forward hook (post true) of one module, for its common
 * call, in C: one tensor in (no keyword arguments), one tensor out. It does what the
 * Python hook (`fallback`, eager_hook's of _ForwardPreHook or _ForwardHook) does for that
 * call, in the same order and with the same objects: the input's or output's record, the
 * call state (CallState, module._Call's twin) with the input's producer, and, after the
 * call, the graph hooks of module._hook_graph_one (the output's node and the edges into
 * the input's producer, on the nodes' NodeHook). Every other call (other arguments or
 * outputs, a tensor subclass, a framework-internal pass, a call outside a model chunk's,
 * a trace running: torch.compiler's flag) goes to `fallback`, whole; the parts of the
 * common call that are not its common case (a view, an output without the one-edge input)
 * call module.py's own functions. Gated, timed and contained as ContainedHook: nothing
 * while the monitor is not active, the time counted (count_busy), an Exception
 * reported under `site`. `row`: the input's row name (names.input(0)) for the pre-hook,
 * the output's (names.output_0) for the forward hook. The monitor's per-thread pass, call
 * table, errors and sum numbers, and the module's names, are read once, here: they are
 * made before the hooks and never replaced. forward_api(...) hands over, once, the torch
 * functions and module.py's helpers it calls. Tracked by the collector (it holds its
 * monitor). Dynamo never sees one: the monitor puts the Python hooks in their place
 * before Dynamo compiles (module.py). */

typedef struct {
    PyObject_HEAD
    PyObject *inputs, *boundary, *scope, *outer;
    /* where the C API took the one input's producer: its node's handle and output number
       (`inputs` is then made from them only if Python code asks for it) */
    void *edge;
    long long edge_nr;
    /* whether the pre-hook ran outside a backward pass (not a recomputation): 1 or 0, -1
       where the Python pre-hook made it (the forward hook then asks again) */
    int outside;
} CallStateObject;

static void call_state_dealloc(CallStateObject *self) {
    if (self->edge != NULL)
        graph_capi->release(self->edge);
    Py_XDECREF(self->inputs);
    Py_XDECREF(self->boundary);
    Py_XDECREF(self->scope);
    Py_XDECREF(self->outer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CallStateType;

static PyObject *call_state_make(PyObject *inputs, PyObject *boundary, PyObject *scope, PyObject *outer) {
    CallStateObject *s = (CallStateObject *)CallStateType.tp_alloc(&CallStateType, 0);
    if (s == NULL)
        return NULL;
    s->inputs = ref_or_none(inputs);
    s->boundary = ref_or_none(boundary);
    s->scope = ref_or_none(scope);
    s->outer = ref_or_none(outer);
    s->outside = -1;
    s->edge = NULL;
    return (PyObject *)s;
}

/* call.inputs where the C API took the producer: [((node, nr),)], the node's Python object
   made now (module.py's fallbacks read it). 0, or -1 with the error set. */
static int call_state_inputs(CallStateObject *self) {
    if (self->edge == NULL || (self->inputs != NULL && self->inputs != Py_None))
        return 0;
    PyObject *node = graph_capi->as_object(self->edge);
    PyObject *nr = node == NULL ? NULL : PyLong_FromLongLong(self->edge_nr);
    PyObject *edge = nr == NULL ? NULL : PyTuple_Pack(2, node, nr);
    PyObject *producer = edge == NULL ? NULL : PyTuple_Pack(1, edge);
    PyObject *inputs = producer == NULL ? NULL : PyList_New(1);
    Py_XDECREF(node);
    Py_XDECREF(nr);
    Py_XDECREF(edge);
    if (inputs == NULL) {
        Py_XDECREF(producer);
        return -1;
    }
    PyList_SET_ITEM(inputs, 0, producer);
    Py_XSETREF(self->inputs, inputs);
    return 0;
}

static PyObject *call_state_get_inputs(CallStateObject *self, void *closure) {
    if (call_state_inputs(self) < 0)
        return NULL;
    return Py_NewRef(self->inputs == NULL ? Py_None : self->inputs);
}

static PyGetSetDef call_state_getset[] = {
    {"inputs", (getter)call_state_get_inputs, NULL, "each input's producer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *call_state_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"inputs", "boundary", "scope", "outer", NULL};
    PyObject *inputs, *boundary, *scope, *outer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:CallState", kwlist, &inputs, &boundary, &scope, &outer))
        return NULL;
    return call_state_make(inputs, boundary, scope, outer);
}

static PyMemberDef call_state_members[] = {
    {"boundary", T_OBJECT, offsetof(CallStateObject, boundary), READONLY, "the first sequence number of the call"},
    {"scope", T_OBJECT, offsetof(CallStateObject, scope), READONLY, NULL},
    {"outer", T_OBJECT, offsetof(CallStateObject, outer), READONLY, "the call it is nested in, or None"},
    {NULL, 0, 0, 0, NULL},
};

/* Not tracked by the collector: it lives from a module's pre-hook to its forward hook, and
   holds a list of graph edges or tensors, an int, a str and another CallState. */
static PyTypeObject CallStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.CallState",
    .tp_basicsize = sizeof(CallStateObject),
    .tp_dealloc = (destructor)call_state_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "module._Call in C: one module call's state between its pre-hook and its forward hook.",
    .tp_members = call_state_members,
    .tp_getset = call_state_getset,
    .tp_new = call_state_new,
};

typedef struct {
    PyObject_HEAD
    PyObject *monitor, *fallback, *site, *vpp, *names, *key, *row;
    PyObject *pass, *calls, *errors, *sum_numbers, *monitor_ref; /* the monitor's, read once */
    PyObject *outs_0, *in_ones, *grad_output_0, *grad_input_0, *in_site; /* the module's names' */
    PyObject *clock; /* the errors' BusyClock, or NULL: errors.busy */
    PyObject *thread_key; /* the call table's key (thread, module) of the thread `thread`, or NULL */
    unsigned long thread;
    int post;
    vectorcallfunc vectorcall;
} CallHookObject;
#define CALL_HOOK_OBJECTS 19

static struct {
    PyObject *current_node, *sequence_nr, *grad_enabled, *tensor_type, *compiler_dict, *known, *classify,
        *producer, *output_edge, *register_fn, *forward, *eval_forward, *node_site, *node_scope;
} fwd;
#define FWD_COUNT 14

static PyObject *str_pass, *str_scope, *str_nodes, *str_calls, *str_grad_fn,
    *str_is_view, *str_output_nr, *str_requires_grad, *str_hook_graph, *str_outs_0, *str_in_ones, *str_add_out,
    *str_add_in, *str_grad_output_0, *str_grad_input, *str_grad_input_site, *str_sum_numbers, *str_register_hook,
    *str_register_prehook, *str_compiling_flag;

static PyObject *py_forward_api(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != FWD_COUNT) {
        PyErr_Format(PyExc_TypeError, "forward_api takes %d arguments", FWD_COUNT);
        return NULL;
    }
    if (!PyType_Check(args[3]) || !PyDict_Check(args[4]) || !PyDict_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "forward_api: the tensor type, the compiler's dict, the known dict");
        return NULL;
    }
    PyObject **slots = (PyObject **)&fwd;
    for (int i = 0; i < FWD_COUNT; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

static PyObject **call_hook_objects(CallHookObject *h, int i) {
    PyObject **fields[CALL_HOOK_OBJECTS] = {
        &h->monitor, &h->fallback, &h->site, &h->vpp, &h->names, &h->key, &h->row, &h->pass, &h->calls,
        &h->errors, &h->sum_numbers, &h->monitor_ref, &h->outs_0, &h->in_ones, &h->grad_output_0, &h->grad_input_0,
        &h->in_site, &h->clock, &h->thread_key};
    return fields[i];
}

static int call_hook_traverse(CallHookObject *self, visitproc visit, void *arg) {
    for (int i = 0; i < CALL_HOOK_OBJECTS; i++)
        Py_VISIT(*call_hook_objects(self, i));
    return 0;
}

static int call_hook_clear(CallHookObject *self) {
    for (int i = 0; i < CALL_HOOK_OBJECTS; i++)
        Py_CLEAR(*call_hook_objects(self, i));
    return 0;
}

static PyObject *call_hook_vectorcall(CallHookObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *call_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor", "fallback", "site", "vpp", "names", "key", "row", "post", NULL};
    PyObject *a[7];
    int post;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOUO!OO!Up:CallHook", kwlist, &a[0], &a[1], &a[2], &PyLong_Type,
                                     &a[3], &a[4], &PyLong_Type, &a[5], &a[6], &post))
        return NULL;
    if (fwd.tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CallHook: forward_api(...) first");
        return NULL;
    }
    CallHookObject *h = (CallHookObject *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    for (int i = 0; i < 7; i++) {
        Py_INCREF(a[i]);
        *call_hook_objects(h, i) = a[i];
    }
    h->post = post;
    h->vectorcall = (vectorcallfunc)call_hook_vectorcall;
    PyObject *monitor = a[0], *names = a[4];
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    h->grad_input_0 = PyObject_CallMethodOneArg(names, str_grad_input, zero);
    Py_DECREF(zero);
    if (h->grad_input_0 == NULL || (h->pass = PyObject_GetAttr(monitor, str_pass)) == NULL || (h->calls = PyObject_GetAttr(monitor, str_calls)) == NULL ||
        (h->errors = PyObject_GetAttr(monitor, str_errors)) == NULL ||
        (h->sum_numbers = PyObject_GetAttr(monitor, str_sum_numbers)) == NULL ||
        (h->monitor_ref = PyWeakref_NewRef(monitor, NULL)) == NULL ||
        (h->outs_0 = PyObject_GetAttr(names, str_outs_0)) == NULL ||
        (h->in_ones = PyObject_GetAttr(names, str_in_ones)) == NULL ||
        (h->grad_output_0 = PyObject_GetAttr(names, str_grad_output_0)) == NULL ||
        (h->in_site = PyObject_GetAttr(names, str_grad_input_site)) == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    h->clock = clock_of(h->errors);
    if (!PyDict_Check(h->calls) || !PyDict_Check(h->in_ones) || !PyIter_Check(h->sum_numbers)) {
        PyErr_SetString(PyExc_TypeError, "CallHook: the monitor's _calls, the names' _in_ones (dicts), _sum_numbers");
        Py_DECREF(h);
        return NULL;
    }
    return (PyObject *)h;
}

/* The monitor's NodeHook of `node` in this pass (module._node_hook): a new reference, or NULL
   with the error set. */
static PyObject *node_hook_by(CallHookObject *self, PyObject *nodes, PyObject *seq, unsigned long long number,
                              PyObject *kind, int *looked_up);

static PyObject *node_hook_of(CallHookObject *self, PyObject *nodes, PyObject *node, int *looked_up) {
    PyObject *seq = PyObject_CallMethodNoArgs(node, str_sequence_nr);
    if (seq == NULL)
        return NULL;
    unsigned long long number = PyLong_AsUnsignedLongLong(seq);
    PyObject *hook = number == (unsigned long long)-1 && PyErr_Occurred()
                         ? NULL : node_hook_by(self, nodes, seq, number, (PyObject *)Py_TYPE(node), looked_up);
    Py_DECREF(seq);
    return hook;
}

/* node_hook_of's lookup by the node's sequence number (`seq`, an int, and `number`, its
   value) and the type of its Python objects (`kind`) */
static PyObject *node_hook_by(CallHookObject *self, PyObject *nodes, PyObject *seq, unsigned long long number,
                              PyObject *kind, int *looked_up) {
    int shared = number == ~0ULL; /* a number nodes of that type share (AccumulateGrad's): no lookup */
    if (looked_up != NULL)
        *looked_up = !shared;
    if (!shared) {
        PyObject *hook = PyDict_GetItemWithError(nodes, seq); /* borrowed */
        if (hook != NULL && Py_TYPE(hook) == &NodeHookType && ((NodeHookObject *)hook)->kind == kind)
            return Py_NewRef(hook);
        if (PyErr_Occurred())
            return NULL;
    }
    PyObject *hook = node_hook_made(&NodeHookType, self->monitor_ref, fwd.node_site, fwd.node_scope, kind,
                                    self->clock);
    if (hook != NULL && !shared && PyDict_SetItem(nodes, seq, hook) < 0)
        Py_CLEAR(hook);
    return hook;
}

/* The C++ graph hooks' register(node, hook, post) and edges_into(target, roots, boundary)
   (frameworks/pytorch/graph_hooks.py), or NULL: torch's Python API (Node.register_hook,
   register_prehook, next_functions). Set by graph_api(). */
static PyObject *graph_register_fn = NULL, *graph_edges_fn = NULL;

static PyObject *py_graph_api(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || (args[0] == Py_None) != (args[1] == Py_None) || (args[0] == Py_None) != (args[2] == Py_None) ||
        (args[0] != Py_None && (!PyCallable_Check(args[0]) || !PyCallable_Check(args[1])))) {
        PyErr_SetString(PyExc_TypeError, "graph_api(register, edges_into, capi): two callables and the C API's "
                                         "capsule, or None three times");
        return NULL;
    }
    if (args[2] != Py_None) {
        const msprobe_graph_capi_t *api = PyCapsule_GetPointer(args[2], "msprobe_monitor_graph.capi");
        if (api == NULL)
            return NULL;
        if (api->version != 4) {
            PyErr_Format(PyExc_ValueError, "graph_api: the C API's version %u, not 4", api->version);
            return NULL;
        }
        if (graph_capi != NULL && graph_capi != api) {
            PyErr_SetString(PyExc_ValueError, "graph_api: another C API is in use already");
            return NULL;
        }
        graph_capi = api;
        api->set_reads(node_hook_reads);
    }
    graph_capi_on = args[2] != Py_None;
    Py_XSETREF(graph_register_fn, args[0] == Py_None ? NULL : (Py_INCREF(args[0]), args[0]));
    Py_XSETREF(graph_edges_fn, args[1] == Py_None ? NULL : (Py_INCREF(args[1]), args[1]));
    Py_RETURN_NONE;
}

/* module._register(hook, node): 0, or -1 with the error set */
/* A NodeHook's registration still to make on its node: the method's name (post-hook or
   pre-hook) with its flag set, or NULL where it is on already */
static PyObject *registration_due(NodeHookObject *h) {
    if (PyTuple_Check(h->ins) && PyTuple_GET_SIZE(h->ins) > 0) {
        if (!h->post) {
            h->post = 1;
            return str_register_hook;
        }
    } else if (!h->pre && !h->post) {
        h->pre = 1;
        return str_register_prehook;
    }
    return NULL;
}

/* register_node_hook for a node of the C API: put from C++, or through the node's Python
   object where the C++ library leaves it (a custom Function's node) */
static int register_capi_node(NodeHookObject *h, const void *node) {
    PyObject *method = registration_due(h);
    if (method == NULL)
        return 0;
    int put = graph_capi->put(node, (PyObject *)h, method == str_register_hook);
    if (put != 0)
        return put < 0 ? -1 : 0;
    PyObject *obj = graph_capi->as_object(node);
    if (obj == NULL)
        return -1;
    PyObject *handle = PyObject_CallMethodOneArg(obj, method, (PyObject *)h);
    Py_DECREF(obj);
    Py_XDECREF(handle);
    return handle == NULL ? -1 : 0;
}

static int register_node_hook(PyObject *hook, PyObject *node) {
    if (Py_TYPE(hook) != &NodeHookType) {
        PyObject *r = PyObject_CallFunctionObjArgs(fwd.register_fn, hook, node, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *method = registration_due((NodeHookObject *)hook);
    if (method == NULL)
        return 0;
    if (graph_register_fn != NULL) {
        PyObject *args[3] = {node, hook, method == str_register_hook ? Py_True : Py_False};
        PyObject *done = PyObject_Vectorcall(graph_register_fn, args, 3, NULL);
        if (done == NULL)
            return -1;
        int put = done == Py_True;
        Py_DECREF(done);
        if (put)
            return 0;
        /* not one of torch's C++ nodes: the Python API */
    }
    PyObject *handle = PyObject_CallMethodOneArg(node, method, hook);
    Py_XDECREF(handle);
    return handle == NULL ? -1 : 0;
}

/* `slots` (a tuple) with `slot` added: a new reference, or NULL with the error set */
static PyObject *tuple_plus(PyObject *slots, PyObject *slot) {
    if (!PyTuple_Check(slots)) {
        PyErr_SetString(PyExc_TypeError, "CallHook: a node hook's slots are not a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(slots);
    PyObject *more = PyTuple_New(n + 1);
    if (more == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(more, i, Py_NewRef(PyTuple_GET_ITEM(slots, i)));
    PyTuple_SET_ITEM(more, n, Py_NewRef(slot));
    return more;
}

/* hook.outs (a NodeHook's) with the slot of output nr of the module's one output added, as
   names.add_out does: 0, or -1 with the error set */
static int add_out_slot(CallHookObject *self, NodeHookObject *h, PyObject *nr) {
    PyObject *outs;
    long at = PyLong_AsLong(nr);
    if (at == -1 && PyErr_Occurred())
        return -1;
    if (at == 0 && PyTuple_Check(h->outs) && PyTuple_GET_SIZE(h->outs) == 0)
        outs = Py_NewRef(self->outs_0);
    else
        outs = PyObject_CallMethodObjArgs(self->names, str_add_out, h->outs, self->vpp, nr, self->grad_output_0, NULL);
    if (outs == NULL)
        return -1;
    Py_XSETREF(h->outs, outs);
    return 0;
}

/* hook.ins (a NodeHook's) with the one-edge grad_input slot of edge e added (names.add_in):
   0, or -1 with the error set */
static int add_in_slot(CallHookObject *self, NodeHookObject *h, PyObject *e) {
    PyObject *ins = NULL;
    if (PyTuple_Check(h->ins) && PyTuple_GET_SIZE(h->ins) == 0) {
        ins = PyDict_GetItemWithError(self->in_ones, e); /* borrowed */
        if (ins == NULL && PyErr_Occurred())
            return -1;
        Py_XINCREF(ins);
    }
    if (ins == NULL && (ins = PyObject_CallMethodObjArgs(self->names, str_add_in, h->ins, e, NULL)) == NULL)
        return -1;
    Py_XSETREF(h->ins, ins);
    return 0;
}

/* The running sum that `parts` edges into one input share: its number (from the monitor's
   _sum_numbers) and count, both new references, where there are several; NULL, NULL for one
   edge. 0, or -1 with the error set. */
static int shared_sum(CallHookObject *self, Py_ssize_t parts, PyObject **number, PyObject **count) {
    *number = *count = NULL;
    if (parts <= 1)
        return 0;
    if ((*number = PyIter_Next(self->sum_numbers)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "CallHook: the sum numbers ran out");
        return -1;
    }
    if ((*count = PyLong_FromSsize_t(parts)) == NULL) {
        Py_CLEAR(*number);
        return -1;
    }
    return 0;
}

/* hook.ins with the grad_input slot of edge e added: the one-edge slot (add_in_slot), or a
   part of the running sum `number` of `count` parts. 0, or -1 with the error set. */
static int add_input_slot(CallHookObject *self, NodeHookObject *h, PyObject *e, PyObject *number, PyObject *count) {
    if (number == NULL)
        return add_in_slot(self, h, e);
    PyObject *slot = PyTuple_Pack(6, self->vpp, e, self->grad_input_0, number, count, self->in_site);
    PyObject *ins = slot == NULL ? NULL : tuple_plus(h->ins, slot);
    Py_XDECREF(slot);
    if (ins == NULL)
        return -1;
    Py_XSETREF(h->ins, ins);
    return 0;
}

/* The grad_input slots of the call's one input, reached by the edges `found` ((node, e)
   pairs), added to their nodes' hooks (module.ModuleMonitor._one_input_slots); the hook
   and node of each appended to `touched`. Several edges share one running sum, numbered
   from the monitor's _sum_numbers. 0, or -1 with the error set. */
static int one_input_slots(CallHookObject *self, PyObject *found, PyObject *nodes, PyObject *touched,
                           PyObject *known_node, PyObject *known_hook) {
    Py_ssize_t parts = PyList_GET_SIZE(found);
    PyObject *number = NULL, *count = NULL;
    if (shared_sum(self, parts, &number, &count) < 0)
        return -1;
    int result = -1;
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *pair = PyList_GET_ITEM(found, i); /* (node, e), made by edges_into */
        PyObject *node = PyTuple_GET_ITEM(pair, 0), *e = PyTuple_GET_ITEM(pair, 1);
        /* the output's own node, most often (a Linear's, a norm's): its hook, looked up already */
        PyObject *hook = node == known_node ? Py_NewRef(known_hook) : node_hook_of(self, nodes, node, NULL);
        if (hook == NULL)
            goto done;
        if (Py_TYPE(hook) != &NodeHookType) {
            Py_DECREF(hook);
            PyErr_SetString(PyExc_TypeError, "CallHook: a node hook that is not a NodeHook");
            goto done;
        }
        int failed = add_input_slot(self, (NodeHookObject *)hook, e, number, count) < 0 ||
                     PyList_Append(touched, hook) < 0 || PyList_Append(touched, node) < 0;
        Py_DECREF(hook);
        if (failed)
            goto done;
    }
    result = 0;
done:
    Py_XDECREF(number);
    Py_XDECREF(count);
    return result;
}

/* The pass's node table (pass.nodes, made where it is None): a new reference, or NULL with
   the error set */
static PyObject *pass_nodes(CallHookObject *self) {
    PyObject *nodes = PyObject_GetAttr(self->pass, str_nodes);
    if (nodes == Py_None) {
        Py_DECREF(nodes);
        if ((nodes = PyDict_New()) != NULL && PyObject_SetAttr(self->pass, str_nodes, nodes) < 0)
            Py_CLEAR(nodes);
    } else if (nodes != NULL && !PyDict_Check(nodes)) {
        Py_CLEAR(nodes);
        PyErr_SetString(PyExc_TypeError, "CallHook: the pass's node table is not a dict");
    }
    return nodes;
}

/* module.ModuleMonitor._hook_graph_one: 0, or -1 with the error set */
static int hook_graph_one(CallHookObject *self, PyObject *output, PyObject *own, PyObject *edge,
                          CallStateObject *call) {
    PyObject *nodes = NULL, *node = NULL, *nr = NULL, *out_hook = NULL, *roots = NULL, *found = NULL;
    PyObject *touched = NULL;
    int result = -1;
    if ((nodes = pass_nodes(self)) == NULL)
        goto done;
    int view = call_truth(output, str_is_view);
    if (view < 0)
        goto done;
    if (view) {
        PyObject *pair = PyObject_CallFunctionObjArgs(fwd.output_edge, output, own, (PyObject *)call, NULL);
        if (pair == NULL)
            goto done;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "CallHook: _output_edge gave no (node, nr)");
            goto done;
        }
        node = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        nr = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    } else {
        node = Py_NewRef(own);
        if ((nr = PyObject_GetAttr(output, str_output_nr)) == NULL)
            goto done;
    }
    int looked_up;
    if ((out_hook = node_hook_of(self, nodes, node, &looked_up)) == NULL)
        goto done;
    if (Py_TYPE(out_hook) != &NodeHookType) {
        PyErr_SetString(PyExc_TypeError, "CallHook: a node hook that is not a NodeHook");
        goto done;
    }
    if (add_out_slot(self, (NodeHookObject *)out_hook, nr) < 0 || (roots = PyList_New(1)) == NULL)
        goto done;
    PyList_SET_ITEM(roots, 0, Py_NewRef(own));
    if (graph_edges_fn != NULL) {
        PyObject *cpp_walk[3] = {edge, roots, call->boundary};
        if ((found = PyObject_Vectorcall(graph_edges_fn, cpp_walk, 3, NULL)) == NULL)
            goto done;
        if (found == Py_None) /* a node that is not one of torch's C++ nodes */
            Py_CLEAR(found);
        else if (!PyList_Check(found)) {
            PyErr_SetString(PyExc_TypeError, "CallHook: the C++ edges_into gave no list");
            goto done;
        }
    }
    PyObject *walk[5] = {fwd.known, fwd.classify, edge, roots, call->boundary};
    if ((found == NULL && (found = py_edges_into(NULL, walk, 5)) == NULL) || (touched = PyList_New(0)) == NULL ||
        one_input_slots(self, found, nodes, touched, looked_up ? node : NULL, out_hook) < 0)
        goto done;
    /* registered as _hook_graph_one does: the output's node first, then each input edge's */
    if (register_node_hook(out_hook, node) < 0)
        goto done;
    for (Py_ssize_t i = 0; i + 1 < PyList_GET_SIZE(touched); i += 2)
        if (register_node_hook(PyList_GET_ITEM(touched, i), PyList_GET_ITEM(touched, i + 1)) < 0)
            goto done;
    result = 0;
done:
    Py_XDECREF(nodes);
    Py_XDECREF(node);
    Py_XDECREF(nr);
    Py_XDECREF(out_hook);
    Py_XDECREF(roots);
    Py_XDECREF(found);
    Py_XDECREF(touched);
    return result;
}

/* The edges walk() found: (node, edge index) pairs, in the order found. */
typedef struct {
    const void **nodes;
    Py_ssize_t *edges;
    Py_ssize_t n, size;
} found_edges_t;

static int found_edge(void *ctx, const void *node, Py_ssize_t e) {
    found_edges_t *f = (found_edges_t *)ctx;
    if (f->n == f->size) {
        Py_ssize_t size = f->size ? 2 * f->size : 4;
        const void **nodes = PyMem_Realloc(f->nodes, size * sizeof *nodes);
        if (nodes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        f->nodes = nodes;
        Py_ssize_t *edges = PyMem_Realloc(f->edges, size * sizeof *edges);
        if (edges == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        f->edges = edges;
        f->size = size;
    }
    f->nodes[f->n] = node;
    f->edges[f->n++] = e;
    return 0;
}

/* The NodeHook of a node of the C API in this pass: a new reference, or NULL with the error
   set; its address in *raw */
static PyObject *capi_node_hook(CallHookObject *self, PyObject *nodes, const void *node, const void **raw,
                                int *looked_up) {
    unsigned long long number;
    PyObject *kind;
    if (graph_capi->describe(node, &number, &kind, raw) < 0)
        return NULL;
    PyObject *seq = PyLong_FromUnsignedLongLong(number);
    if (seq == NULL)
        return NULL;
    PyObject *hook = node_hook_by(self, nodes, seq, number, kind, looked_up);
    Py_DECREF(seq);
    if (hook != NULL && Py_TYPE(hook) != &NodeHookType) {
        Py_DECREF(hook);
        PyErr_SetString(PyExc_TypeError, "CallHook: a node hook that is not a NodeHook");
        return NULL;
    }
    return hook;
}

/* hook_graph_one through the C API: the output's node `own` (output number `nr`) and the
   input's producer taken by the pre-hook (call->edge), walked and hooked in C++ with no
   Python object for a node. The same slots on the same nodes, registered in the same order.
   0, or -1 with the error set. */
static int hook_graph_capi(CallHookObject *self, const void *own, long long nr, CallStateObject *call) {
    PyObject *nodes = NULL, *nr_obj = NULL, *out_hook = NULL, *number = NULL, *count = NULL;
    PyObject **hooks = NULL;
    found_edges_t found = {NULL, NULL, 0, 0};
    int result = -1;
    if ((nodes = pass_nodes(self)) == NULL)
        goto done;
    const void *own_raw;
    int looked_up;
    if ((out_hook = capi_node_hook(self, nodes, own, &own_raw, &looked_up)) == NULL ||
        (nr_obj = PyLong_FromLongLong(nr)) == NULL || add_out_slot(self, (NodeHookObject *)out_hook, nr_obj) < 0)
        goto done;
    long long boundary = PyLong_AsLongLong(call->boundary);
    if (boundary == -1 && PyErr_Occurred())
        goto done;
    if (graph_capi->walk(&own, 1, call->edge, call->edge_nr, boundary, found_edge, &found) < 0)
        goto done;
    /* one_input_slots: several edges share one running sum */
    Py_ssize_t parts = found.n;
    if (shared_sum(self, parts, &number, &count) < 0)
        goto done;
    if (parts > 0 && (hooks = PyMem_Calloc(parts, sizeof *hooks)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < parts; i++) {
        const void *raw;
        PyObject *hook;
        if (graph_capi->describe(found.nodes[i], &(unsigned long long){0}, &(PyObject *){NULL}, &raw) < 0)
            goto done;
        /* the output's own node, most often (a Linear's, a norm's): its hook, looked up already */
        hook = looked_up && raw == own_raw ? Py_NewRef(out_hook) : capi_node_hook(self, nodes, found.nodes[i], &raw, NULL);
        if (hook == NULL)
            goto done;
        hooks[i] = hook;
        PyObject *e = PyLong_FromSsize_t(found.edges[i]);
        if (e == NULL)
            goto done;
        int failed = add_input_slot(self, (NodeHookObject *)hook, e, number, count) < 0;
        Py_DECREF(e);
        if (failed)
            goto done;
    }
    /* registered as _hook_graph_one does: the output's node first, then each input edge's */
    if (register_capi_node((NodeHookObject *)out_hook, own) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < parts; i++)
        if (register_capi_node((NodeHookObject *)hooks[i], found.nodes[i]) < 0)
            goto done;
    result = 0;
done:
    if (hooks != NULL) {
        for (Py_ssize_t i = 0; i < parts; i++)
            Py_XDECREF(hooks[i]);
        PyMem_Free(hooks);
    }
    PyMem_Free(found.nodes);
    PyMem_Free(found.edges);
    Py_XDECREF(nodes);
    Py_XDECREF(nr_obj);
    Py_XDECREF(out_hook);
    Py_XDECREF(number);
    Py_XDECREF(count);
    return result;
}

/* read(t, vpp, row, scope) appended to monitor._records: 0, or -1 with the error set */
static int record_into(CallHookObject *self, PyObject *t, PyObject *scope) {
    PyObject *call_args[4] = {t, self->vpp, self->row, scope};
    return read_into(self->monitor, str_read, call_args);
}

/* whether torch._C._current_autograd_node() is None (not inside a backward pass: a
   recomputation records no forward rows): 1, 0, or -1 with the error set */
static int outside_backward(void) {
    PyObject *node = PyObject_CallNoArgs(fwd.current_node);
    if (node == NULL)
        return -1;
    int none = node == Py_None;
    Py_DECREF(node);
    return none;
}

/* the call state's key, (thread, module) */
static PyObject *call_key(CallHookObject *self) {
    unsigned long thread = PyThread_get_thread_ident();
    if (self->thread_key != NULL && self->thread == thread) /* the same thread as last time, most often */
        return Py_NewRef(self->thread_key);
    PyObject *ident = PyLong_FromUnsignedLong(thread);
    if (ident == NULL)
        return NULL;
    PyObject *key = PyTuple_Pack(2, ident, self->key);
    Py_DECREF(ident);
    if (key != NULL) {
        Py_XSETREF(self->thread_key, Py_NewRef(key));
        self->thread = thread;
    }
    return key;
}

/* module._producer(t): its graph edges, or the tensor where it has no grad_fn (a new
   reference, or NULL with the error set) */
static PyObject *producer_of(PyObject *t) {
    PyObject *fn = PyObject_GetAttr(t, str_grad_fn);
    if (fn == NULL || fn == Py_None) {
        Py_XDECREF(fn);
        return fn == NULL ? NULL : Py_NewRef(t);
    }
    PyObject *producer = NULL;
    int view = call_truth(t, str_is_view);
    if (view > 0) { /* a view's edges and its base's (module._grad_edges) */
        producer = PyObject_CallOneArg(fwd.producer, t);
    } else if (view == 0) {
        PyObject *nr = PyObject_GetAttr(t, str_output_nr);
        PyObject *edge = nr == NULL ? NULL : PyTuple_Pack(2, fn, nr);
        Py_XDECREF(nr);
        producer = edge == NULL ? NULL : PyTuple_Pack(1, edge);
        Py_XDECREF(edge);
    }
    Py_DECREF(fn);
    return producer;
}

/* ModuleMonitor._before_forward of the common call: 0, or -1 with the error set */
static int before_forward(CallHookObject *self, PyObject *t, PyObject *scope) {
    PyObject *boundary = NULL, *producer = NULL, *inputs = NULL, *key = NULL, *call = NULL;
    int result = -1;
    int outside = outside_backward();
    if (outside < 0 || (outside && record_into(self, t, scope) < 0))
        goto done;
    if ((boundary = PyObject_CallNoArgs(fwd.sequence_nr)) == NULL)
        goto done;
    void *edge = NULL;
    long long edge_nr = 0;
    if (graph_capi_on && (edge = graph_capi->edge_of(t, &edge_nr)) == NULL && PyErr_Occurred())
        goto done;
    if (edge == NULL) {
        if ((producer = producer_of(t)) == NULL || (inputs = PyList_New(1)) == NULL)
            goto done;
        PyList_SET_ITEM(inputs, 0, producer);
        producer = NULL;
    }
    if ((key = call_key(self)) == NULL) {
        if (edge != NULL)
            graph_capi->release(edge);
        goto done;
    }
    PyObject *outer = PyDict_GetItemWithError(self->calls, key); /* borrowed */
    if (outer == NULL && PyErr_Occurred()) {
        if (edge != NULL)
            graph_capi->release(edge);
        goto done;
    }
    if ((call = call_state_make(inputs, boundary, scope, outer == NULL ? Py_None : outer)) == NULL) {
        if (edge != NULL)
            graph_capi->release(edge);
        goto done;
    }
    ((CallStateObject *)call)->outside = outside; /* the forward hook runs where its pre-hook ran */
    ((CallStateObject *)call)->edge = edge;
    ((CallStateObject *)call)->edge_nr = edge_nr;
    if (PyDict_SetItem(self->calls, key, call) < 0)
        goto done;
    result = 0;
done:
    Py_XDECREF(boundary);
    Py_XDECREF(producer);
    Py_XDECREF(inputs);
    Py_XDECREF(key);
    Py_XDECREF(call);
    return result;
}

/* call.inputs[0][0] where the call's inputs are one producer of one edge (module._one_edge):
   borrowed; NULL where they are not */
static PyObject *one_edge(CallStateObject *call) {
    PyObject *inputs = call->inputs;
    if (inputs == NULL)
        return NULL;
    if (PyList_Check(inputs) && PyList_GET_SIZE(inputs) == 1) {
        PyObject *producer = PyList_GET_ITEM(inputs, 0);
        if (PyTuple_CheckExact(producer) && PyTuple_GET_SIZE(producer) == 1)
            return PyTuple_GET_ITEM(producer, 0);
    }
    return NULL;
}

/* ModuleMonitor._after_forward of a call with one tensor output, its call state `call`
   (taken off the call table by the caller): 0, or -1 with the error set */
static int after_forward(CallHookObject *self, PyObject *output, CallStateObject *call) {
    int outside = call->outside >= 0 ? call->outside : outside_backward();
    if (outside < 0 || (outside && record_into(self, output, call->scope) < 0))
        return -1;
    int wants = attr_truth(output, str_requires_grad);
    if (wants > 0) {
        PyObject *enabled = PyObject_CallNoArgs(fwd.grad_enabled);
        wants = enabled == NULL ? -1 : PyObject_IsTrue(enabled);
        Py_XDECREF(enabled);
    }
    if (wants <= 0)
        return wants;
    if (call->edge != NULL) {
        long long nr = 0;
        void *own = graph_capi->edge_of(output, &nr);
        if (own != NULL) {
            int result = hook_graph_capi(self, own, nr, call);
            graph_capi->release(own);
            return result;
        }
        /* a view, or a custom Function's output: the objects of the Python path */
        if (PyErr_Occurred() || call_state_inputs(call) < 0)
            return -1;
    }
    PyObject *edge = one_edge(call);
    PyObject *own = PyObject_GetAttr(output, str_grad_fn);
    if (own == NULL)
        return -1;
    int result;
    if (edge != NULL && own != Py_None) {
        result = hook_graph_one(self, output, own, edge, call);
    } else {
        PyObject *outputs = PyTuple_Pack(1, output);
        PyObject *grad_names = outputs == NULL ? NULL : PyTuple_Pack(1, self->grad_output_0);
        PyObject *r = grad_names == NULL ? NULL : PyObject_CallMethodObjArgs(
            self->monitor, str_hook_graph, self->vpp, self->names, outputs, grad_names, (PyObject *)call, NULL);
        result = r == NULL ? -1 : 0;
        Py_XDECREF(r);
        Py_XDECREF(outputs);
        Py_XDECREF(grad_names);
    }
    Py_DECREF(own);
    return result;
}

static PyObject *call_hook_vectorcall(CallHookObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *monitor = self->monitor, *t, *key = NULL, *scope;
    CallStateObject *call = NULL;
    double start = monotonic_seconds();
    int failed = -1;
    if (kwnames != NULL || nargs != 3 + self->post)
        goto fallback;
    int active = attr_truth(monitor, str_active);
    if (active == 0)
        return none_ref();
    if (active < 0)
        goto done;
    /* a trace (torch.export, make_fx) sets torch.compiler's flag: the Python hook knows */
    PyObject *flag = PyDict_GetItemWithError(fwd.compiler_dict, str_compiling_flag); /* borrowed */
    if (flag != Py_False) {
        if (flag == NULL && PyErr_Occurred())
            goto done;
        goto fallback;
    }
    if (!self->post) {
        PyObject *inputs = args[1], *kwargs = args[2];
        if (!PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) != 1 || !PyDict_Check(kwargs) ||
            PyDict_GET_SIZE(kwargs) != 0 || Py_TYPE(PyTuple_GET_ITEM(inputs, 0)) != (PyTypeObject *)fwd.tensor_type)
            goto fallback;
        t = PyTuple_GET_ITEM(inputs, 0);
    } else {
        t = args[3];
        if (Py_TYPE(t) != (PyTypeObject *)fwd.tensor_type)
            goto fallback;
    }
    if (!self->post) {
        /* the pass's scope: None in a framework-internal pass or outside the chunks' calls */
        if ((scope = PyObject_GetAttr(self->pass, str_scope)) == NULL)
            goto done;
        Py_DECREF(scope); /* borrowed from here on: the rows module holds every scope string */
        if (!PyUnicode_CheckExact(scope)) /* None: the Python hook decides */
            goto fallback;
        failed = before_forward(self, t, scope);
        goto done;
    }
    /* The call state: none (a hook put on during the call, an internal pass), or the
       Python hook's: the Python hook. A pre-hook makes one only outside an internal pass,
       and the chunk calls and internal passes inside the module's call are over when its
       forward hook runs: the pass is as the pre-hook saw it. */
    if ((key = call_key(self)) == NULL)
        goto done;
    PyObject *found = PyDict_GetItemWithError(self->calls, key); /* borrowed */
    if (found == NULL || Py_TYPE(found) != &CallStateType) {
        if (PyErr_Occurred())
            goto done;
        Py_DECREF(key);
        goto fallback;
    }
    call = (CallStateObject *)Py_NewRef(found);
    failed = call->outer == Py_None ? PyDict_DelItem(self->calls, key) : PyDict_SetItem(self->calls, key, call->outer);
    if (failed == 0)
        failed = after_forward(self, t, call);
done:
    /* contained as ContainedHook contains: an Exception is reported under the hook's site */
    Py_XDECREF(key);
    Py_XDECREF(call);
    if (failed != 0 && node_hook_contain(self->errors, self->site) != 0)
        return NULL;
    if (count_busy(self->clock, self->errors, monotonic_seconds() - start) != 0)
        return NULL;
    return none_ref(); /* a hook that returns a value could replace a tensor */
    return NULL;
fallback:
    return PyObject_Vectorcall(self->fallback, args, nargs, kwnames);
}

static PyMemberDef call_hook_members[] = {
    {"site", T_OBJECT, offsetof(CallHookObject, site), READONLY, NULL},
    {"fallback", T_OBJECT, offsetof(CallHookObject, fallback), READONLY, "the Python hook of every other call"},
    {"post", T_INT, offsetof(CallHookObject, post), READONLY, "a forward hook (not a pre-hook)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CallHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.CallHook",
    .tp_basicsize = sizeof(CallHookObject),
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_vectorcall_offset = offsetof(CallHookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The module monitor's forward pre-hook or forward hook of one module, its common call in C.",
    .tp_traverse = (traverseproc)call_hook_traverse,
    .tp_clear = (inquiry)call_hook_clear,
    .tp_members = call_hook_members,
    .tp_new = call_hook_new,
};

/* ---------------------------------------------------------------- module call wrapper
 * CallWrapper(module, pre, post, hook_instead, global_hooks): a module's `forward` for the
 * monitor's written steps, set in the module's instance dictionary (module.py) of a module
 * with no hooks. torch's Module._call_impl takes its fast path (no hook dispatch in Python:
 * about 3.5 us a call on torch 2.13) for a module without hooks, and calls `self.forward`,
 * which is then this object: it calls `pre` (module, args, kwargs), the forward its class
 * has now (looked up at each call, as `self.forward` would be without it, so a class whose
 * forward is replaced later is followed), and `post` (module, args, kwargs, output), also
 * where forward raises (with None, as torch calls an always_call hook; the exception goes
 * on). `pre` and `post` are the module's CallHooks: they contain their own errors. With no
 * other hook, the two see what hooks would see. A module that has gained a hook since
 * (its own forward, backward or pre-hooks, or torch's global ones: `global_hooks`, a tuple
 * of dicts) is handed to `hook_instead(module)` before its forward runs, which puts the
 * monitor's hooks on it first among its hooks (where they would have been) and returns
 * True: then `pre` is called here for this call and `post` is left to the hook, which
 * torch calls after the forward in the same call. `armed` 0: a plain call of the forward
 * (module.py disarms a wrapper it cannot take out of a chain someone built on it).
 * Attributes it does not have are its forward's (a bound method's `__func__`, `__self__`,
 * `__name__`...), and `__wrapped__` is that bound method, so that
 * inspect.signature(module.forward) is the forward's. Tracked by the collector: the module
 * holds it and it holds the module. */

typedef struct {
    PyObject_HEAD
    PyObject *module, *pre, *post, *hook_instead, *global_hooks;
    int armed;
} CallWrapperObject;

static PyObject *str_forward, *str_wrapped;
/* the module's hook dictionaries whose entries put its calls on torch's slow path */
static PyObject *str_module_hook_dicts[4];

static int call_wrapper_traverse(CallWrapperObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->module);
    Py_VISIT(self->pre);
    Py_VISIT(self->post);
    Py_VISIT(self->hook_instead);
    Py_VISIT(self->global_hooks);
    return 0;
}

static int call_wrapper_clear(CallWrapperObject *self) {
    Py_CLEAR(self->module);
    Py_CLEAR(self->pre);
    Py_CLEAR(self->post);
    Py_CLEAR(self->hook_instead);
    Py_CLEAR(self->global_hooks);
    return 0;
}

static PyObject *call_wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"module", "pre", "post", "hook_instead", "global_hooks", NULL};
    PyObject *module, *pre, *post, *hook_instead, *global_hooks;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO!:CallWrapper", kwlist, &module, &pre, &post, &hook_instead,
                                     &PyTuple_Type, &global_hooks))
        return NULL;
    if (!PyCallable_Check(pre) || !PyCallable_Check(post) || !PyCallable_Check(hook_instead)) {
        PyErr_SetString(PyExc_TypeError, "CallWrapper: pre, post and hook_instead are callables");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(global_hooks); i++) {
        if (!PyDict_Check(PyTuple_GET_ITEM(global_hooks, i))) {
            PyErr_SetString(PyExc_TypeError, "CallWrapper: global_hooks is a tuple of dicts");
            return NULL;
        }
    }
    CallWrapperObject *w = (CallWrapperObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->module = Py_NewRef(module);
    w->pre = Py_NewRef(pre);
    w->post = Py_NewRef(post);
    w->hook_instead = Py_NewRef(hook_instead);
    w->global_hooks = Py_NewRef(global_hooks);
    w->armed = 1;
    return (PyObject *)w;
}

/* Whether a call of `module` takes torch's slow path: a hook of its own or a global one (1)
   or none (0). Never an error for the training code: a dictionary that cannot be read
   counts as no hook (the wrapper then calls both parts itself, as for any module). */
static int has_hooks(CallWrapperObject *self) {
    PyObject *globals = self->global_hooks;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(globals); i++)
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(globals, i)) > 0)
            return 1;
    PyObject *entries = PyObject_GenericGetDict(self->module, NULL);
    if (entries == NULL) {
        PyErr_Clear();
        return 0;
    }
    int found = 0;
    for (int i = 0; i < 4 && !found; i++) {
        PyObject *hooks = PyDict_GetItemWithError(entries, str_module_hook_dicts[i]); /* borrowed */
        found = hooks != NULL && PyDict_Check(hooks) && PyDict_GET_SIZE(hooks) > 0;
    }
    PyErr_Clear();
    Py_DECREF(entries);
    return found;
}

/* The module's forward as `module.forward` would give it without the wrapper: its class's
   attribute, bound where it is a descriptor (a new reference, or NULL with the error set). */
static PyObject *bind_forward(PyObject *descr, PyObject *module) {
    descrgetfunc get = Py_TYPE(descr)->tp_descr_get;
    PyObject *bound = get == NULL ? Py_NewRef(descr) : get(descr, module, (PyObject *)Py_TYPE(module));
    Py_DECREF(descr);
    return bound;
}

static PyObject *class_forward(PyObject *module) {
    PyObject *descr = PyObject_GetAttr((PyObject *)Py_TYPE(module), str_forward);
    return descr == NULL ? NULL : bind_forward(descr, module);
}

/* the class's forward called on (module, *args, **kwargs): a new reference, or NULL */
static PyObject *call_forward(PyObject *module, PyObject *args, PyObject *kwargs) {
    PyObject *descr = PyObject_GetAttr((PyObject *)Py_TYPE(module), str_forward);
    if (descr == NULL)
        return NULL;
    PyObject *result;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (PyFunction_Check(descr) && n < 8) { /* the common case: no bound method made */
        PyObject *stack[9];
        stack[0] = module;
        for (Py_ssize_t i = 0; i < n; i++)
            stack[i + 1] = PyTuple_GET_ITEM(args, i);
        result = PyObject_VectorcallDict(descr, stack, n + 1, kwargs);
        Py_DECREF(descr);
        return result;
    }
    PyObject *bound = bind_forward(descr, module);
    if (bound == NULL)
        return NULL;
    result = PyObject_Call(bound, args, kwargs);
    Py_DECREF(bound);
    return result;
}

static PyObject *call_wrapper_call(CallWrapperObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *module = self->module;
    if (!self->armed || module == NULL)
        return module == NULL ? PyErr_Format(PyExc_RuntimeError, "CallWrapper: cleared") : call_forward(module, args, kwargs);
    PyObject *kw = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
    if (kw == NULL)
        return NULL;
    /* Keep the hooks alive through the call: module.py may take the wrapper out of the
       module during it (a compile starting inside the forward). */
    PyObject *pre = Py_NewRef(self->pre), *post = Py_NewRef(self->post), *output = NULL, *r;
    Py_INCREF(module);
    PyObject *stack[4] = {module, args, kw, NULL};
    int hooked = has_hooks(self);
    if (hooked > 0 && self->hook_instead == Py_None) { /* a replica: its hooks are its module's */
        output = call_forward(module, args, kw);
        goto done;
    }
    if (hooked > 0) { /* the monitor's hooks go on; this call's post is theirs if they did */
        r = PyObject_CallOneArg(self->hook_instead, module);
        if (r == NULL)
            goto done;
        hooked = r == Py_True;
        Py_DECREF(r);
    }
    if ((r = PyObject_Vectorcall(pre, stack, 3, NULL)) == NULL) /* not an Exception: pre contains those */
        goto done;
    Py_DECREF(r);
    output = call_forward(module, args, kw);
    if (hooked) /* the forward hook torch calls next is the monitor's */
        goto done;
    if (output == NULL) { /* as torch's always_call hook: called with None, its own error dropped */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        stack[3] = Py_None;
        r = PyObject_Vectorcall(post, stack, 4, NULL);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
        goto done;
    }
    stack[3] = output;
    r = PyObject_Vectorcall(post, stack, 4, NULL);
    if (r == NULL)
        Py_CLEAR(output);
    Py_XDECREF(r);
done:
    Py_DECREF(module);
    Py_DECREF(pre);
    Py_DECREF(post);
    Py_DECREF(kw);
    return output;
}

/* attributes it has not: its forward's (a bound method's, as `module.forward` would be) */
static PyObject *call_wrapper_getattro(CallWrapperObject *self, PyObject *name) {
    PyObject *found = PyObject_GenericGetAttr((PyObject *)self, name);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError) || self->module == NULL)
        return found;
    PyErr_Clear();
    PyObject *bound = class_forward(self->module);
    if (bound == NULL)
        return NULL;
    if (PyUnicode_Check(name) && PyUnicode_Compare(name, str_wrapped) == 0)
        return bound;
    found = PyObject_GetAttr(bound, name);
    Py_DECREF(bound);
    return found;
}

/* bound_to(module): the same wrapper for another module (a DataParallel replica of its own,
   whose hook dictionaries are its module's: where they hold hooks, the replica's calls are
   theirs, the monitor's included, and the wrapper only calls the forward) */
static PyObject *call_wrapper_bound_to(CallWrapperObject *self, PyObject *module) {
    if (self->pre == NULL)
        return PyErr_Format(PyExc_RuntimeError, "CallWrapper: cleared");
    CallWrapperObject *w = (CallWrapperObject *)Py_TYPE(self)->tp_alloc(Py_TYPE(self), 0);
    if (w == NULL)
        return NULL;
    w->module = Py_NewRef(module);
    w->pre = Py_NewRef(self->pre);
    w->post = Py_NewRef(self->post);
    w->hook_instead = Py_NewRef(Py_None);
    w->global_hooks = Py_NewRef(self->global_hooks);
    w->armed = self->armed;
    return (PyObject *)w;
}

/* A copy or a pickle of the wrapper is its module's plain forward (a bound method, which
   copy.deepcopy binds to the module's copy and pickle as getattr(module, "forward")): the
   monitor's part never travels, even where a wrapper was left in a module. */
static PyObject *call_wrapper_reduce(CallWrapperObject *self, PyObject *unused) {
    if (self->module == NULL)
        return PyErr_Format(PyExc_TypeError, "CallWrapper: cleared");
    PyObject *bound = class_forward(self->module);
    if (bound == NULL)
        return NULL;
    PyObject *reduced = PyObject_CallMethod(bound, "__reduce__", NULL);
    Py_DECREF(bound);
    return reduced;
}

static PyObject *call_wrapper_deepcopy(CallWrapperObject *self, PyObject *memo) {
    if (self->module == NULL)
        return PyErr_Format(PyExc_TypeError, "CallWrapper: cleared");
    PyObject *copy = PyImport_ImportModule("copy");
    PyObject *bound = copy == NULL ? NULL : class_forward(self->module);
    PyObject *copied = bound == NULL ? NULL : PyObject_CallMethod(copy, "deepcopy", "OO", bound, memo);
    Py_XDECREF(copy);
    Py_XDECREF(bound);
    return copied;
}

static PyObject *call_wrapper_copy(CallWrapperObject *self, PyObject *unused) {
    if (self->module == NULL)
        return PyErr_Format(PyExc_TypeError, "CallWrapper: cleared");
    return class_forward(self->module);
}

static PyMethodDef call_wrapper_methods[] = {
    {"bound_to", (PyCFunction)call_wrapper_bound_to, METH_O, "the same wrapper for another module"},
    {"__reduce__", (PyCFunction)call_wrapper_reduce, METH_NOARGS, "pickled as its module's forward"},
    {"__deepcopy__", (PyCFunction)call_wrapper_deepcopy, METH_O, "copied as its module's forward"},
    {"__copy__", (PyCFunction)call_wrapper_copy, METH_NOARGS, "copied as its module's forward"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef call_wrapper_members[] = {
    {"armed", T_INT, offsetof(CallWrapperObject, armed), 0, "0: a plain call of the forward"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *call_wrapper_repr(CallWrapperObject *self) {
    if (self->module == NULL)
        return PyUnicode_FromString("<msprobe monitor's call of a forward (cleared)>");
    return PyUnicode_FromFormat("<msprobe monitor's call of %s.forward>", Py_TYPE(self->module)->tp_name);
}

static PyTypeObject CallWrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.CallWrapper",
    .tp_basicsize = sizeof(CallWrapperObject),
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_call = (ternaryfunc)call_wrapper_call,
    .tp_getattro = (getattrofunc)call_wrapper_getattro,
    .tp_repr = (reprfunc)call_wrapper_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A module's forward with the monitor's pre and post calls around it, for its written steps.",
    .tp_traverse = (traverseproc)call_wrapper_traverse,
    .tp_clear = (inquiry)call_wrapper_clear,
    .tp_members = call_wrapper_members,
    .tp_methods = call_wrapper_methods,
    .tp_new = call_wrapper_new,
};

/* forwards_replaced(wrapped): of the (module, wrapper) pairs in the list `wrapped`, those
   whose module's instance dictionary no longer holds that wrapper as `forward` (someone
   replaced or removed it: ModuleHooks.replaced), a new list, empty where none. The module
   monitor asks before every model chunk's call on written steps: about 0.4 us a module
   through vars() in Python, one dictionary read each here. */
static PyObject *py_forwards_replaced(PyObject *self, PyObject *wrapped) {
    if (!PyList_Check(wrapped))
        return PyErr_Format(PyExc_TypeError, "forwards_replaced: a list of (module, wrapper) pairs");
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(wrapped); i++) {
        PyObject *pair = PyList_GET_ITEM(wrapped, i); /* borrowed */
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "forwards_replaced: a list of (module, wrapper) pairs");
            goto fail;
        }
        PyObject *entries = PyObject_GenericGetDict(PyTuple_GET_ITEM(pair, 0), NULL);
        if (entries == NULL)
            goto fail;
        /* compared by identity only: the entry is not used after the dictionary's release */
        PyObject *now = PyDict_Check(entries) ? PyDict_GetItemWithError(entries, str_forward) : NULL;
        Py_DECREF(entries);
        if (now == NULL && PyErr_Occurred())
            goto fail;
        if (now != PyTuple_GET_ITEM(pair, 1) && PyList_Append(found, pair) < 0)
            goto fail;
    }
    return found;
fail:
    Py_DECREF(found);
    return NULL;
}

/* ---------------------------------------------------------------- Recorder
 * The engine's record(t, plan, vpp_stage, name, scope, micro_step, cache=True) for one
 * plan, as one C object: recorder(t, vpp_stage, name, scope[, micro_step]). The module
 * monitor records every module's inputs, outputs and gradients on every written step
 * (3,000 tensors a step on a deep model), and the Python method around tensor_record
 * (its argument list, the cache dict's lookup, the attribute reads) cost more than the
 * read itself. The fixed arguments are kept here, torch.get_num_threads is asked at each
 * call as the Python method asks it, and a tensor tensor_record does not take goes to
 * `slow(t, vpp_stage, name, scope, micro_step)`, the rest of the Python method. The cache
 * dict is the engine's own for this plan: cleared, never replaced, at each step's end. */
typedef struct {
    PyObject_HEAD
    PyObject *fixed[7]; /* plain_types, codes, strided, threads_fn, nans, zeros, cache */
    PyObject *slow;
} RecorderObject;

static int recorder_traverse(RecorderObject *self, visitproc visit, void *arg) {
    for (int i = 0; i < 7; i++)
        Py_VISIT(self->fixed[i]);
    Py_VISIT(self->slow);
    return 0;
}

static int recorder_clear(RecorderObject *self) {
    for (int i = 0; i < 7; i++)
        Py_CLEAR(self->fixed[i]);
    Py_CLEAR(self->slow);
    return 0;
}

static PyObject *recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"plain_types", "codes", "strided", "threads", "nans", "zeros", "cache", "slow", NULL};
    PyObject *a[8];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OOOOOO:Recorder", kwlist, &a[0], &PyDict_Type, &a[1], &a[2],
                                     &a[3], &a[4], &a[5], &a[6], &a[7]))
        return NULL;
    if (!PyAnySet_Check(a[0]) || !PyCallable_Check(a[3]) || !PyCallable_Check(a[7]) ||
        (a[6] != Py_None && !PyDict_Check(a[6]))) {
        PyErr_SetString(PyExc_TypeError, "Recorder: plain_types a set, threads and slow callables, cache a dict or None");
        return NULL;
    }
    RecorderObject *r = (RecorderObject *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    for (int i = 0; i < 7; i++) {
        Py_INCREF(a[i]);
        r->fixed[i] = a[i];
    }
    Py_INCREF(a[7]);
    r->slow = a[7];
    return (PyObject *)r;
}

static PyObject *recorder_call(RecorderObject *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if ((kwds != NULL && PyDict_GET_SIZE(kwds) != 0) || n < 4 || n > 5) {
        PyErr_SetString(PyExc_TypeError, "recorder(t, vpp_stage, name, scope[, micro_step])");
        return NULL;
    }
    PyObject *micro = n == 5 ? PyTuple_GET_ITEM(args, 4) : Py_None;
    PyObject *threads = PyObject_CallNoArgs(self->fixed[3]);
    if (threads == NULL)
        return NULL;
    PyObject *call[12] = {PyTuple_GET_ITEM(args, 0), self->fixed[0], self->fixed[1], self->fixed[2], threads,
                          self->fixed[4], self->fixed[5], PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2),
                          PyTuple_GET_ITEM(args, 3), micro, self->fixed[6]};
    PyObject *rec = py_tensor_record(NULL, call, 12);
    Py_DECREF(threads);
    if (rec != Py_None)
        return rec; /* a record, or NULL with the error */
    Py_DECREF(rec);
    PyObject *slow_args[5] = {call[0], call[7], call[8], call[9], micro};
    return PyObject_Vectorcall(self->slow, slow_args, 5, NULL);
}

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_msprobe_monitor_native.Recorder",
    .tp_basicsize = sizeof(RecorderObject),
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_call = (ternaryfunc)recorder_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TorchStatsEngine.record for one plan with the same-tensor cache (see stats.py, recorder).",
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_new = recorder_new,
};

/* records_of(tensors, plain_types, codes, strided, keys, threads, nans, zeros) -> [Record,
   ...] or None: record_many's common case in one call, where the kernel reads every one of
   the tensors (each checked as tensor_record checks it; record i under row key keys[i],
   with an inline vector); None, no error set, where one of them is not one it reads. */
static PyObject *py_records_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "records_of takes 8 arguments");
        return NULL;
    }
    if (!PyAnySet_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "records_of: plain_types a set, codes a dict");
        return NULL;
    }
    PyObject *tensors = PySequence_Fast(args[0], "records_of: tensors must be a sequence");
    PyObject *keys = tensors == NULL ? NULL : PySequence_Fast(args[4], "records_of: keys must be a sequence");
    PyObject *out = NULL;
    void **ptrs = NULL;
    int64_t *counts = NULL;
    int *codes = NULL;
    if (keys == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
    if (PySequence_Fast_GET_SIZE(keys) != n) {
        PyErr_SetString(PyExc_ValueError, "records_of: one key per tensor");
        goto done;
    }
    int threads = (int)PyLong_AsLong(args[5]);
    int want_nans = PyObject_IsTrue(args[6]), want_zeros = PyObject_IsTrue(args[7]);
    if ((threads == -1 && PyErr_Occurred()) || want_nans < 0 || want_zeros < 0)
        goto done;
    ptrs = PyMem_Malloc(sizeof(void *) * (n ? n : 1));
    counts = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    codes = PyMem_Malloc(sizeof(int) * (n ? n : 1));
    if (ptrs == NULL || counts == NULL || codes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dtype = NULL;
        int ok = kernel_buffer(PySequence_Fast_GET_ITEM(tensors, i), args[1], args[2], args[3], &ptrs[i], &counts[i],
                               &codes[i], &dtype);
        Py_XDECREF(dtype);
        if (ok <= 0) { /* the Python path looks at each tensor, and says what is wrong */
            PyErr_Clear();
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
    }
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        double stats_out[4];
        int64_t zeros = 0;
        int64_t nans = run_stats(ptrs[i], counts[i], codes[i], threads, stats_out, want_zeros ? &zeros : NULL);
        PyObject *numel = PyLong_FromLongLong(counts[i]);
        PyObject *nan_count = want_nans ? PyLong_FromLongLong(nans) : none_ref();
        PyObject *zero_count = want_zeros ? PyLong_FromLongLong(zeros) : none_ref();
        PyObject *rec = numel && nan_count && zero_count ?
            record_of(PySequence_Fast_GET_ITEM(keys, i), NULL, nan_count, numel, zero_count) : NULL;
        Py_XDECREF(numel);
        Py_XDECREF(nan_count);
        Py_XDECREF(zero_count);
        if (rec == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        set_inline(rec, stats_out, nans);
        PyList_SET_ITEM(out, i, rec);
    }
done:
    PyMem_Free(ptrs);
    PyMem_Free(counts);
    PyMem_Free(codes);
    Py_XDECREF(tensors);
    Py_XDECREF(keys);
    return out;
}

static PyObject *py_dtypes(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(msprobe_stats_dtypes());
}

static PyMethodDef methods[] = {
    {"stats", (PyCFunction)(void (*)(void))py_stats, METH_FASTCALL, "one buffer"},
    {"stats_zeros", (PyCFunction)(void (*)(void))py_stats_zeros, METH_FASTCALL, "one buffer, with zeros"},
    {"stats_many", (PyCFunction)(void (*)(void))py_stats_many, METH_FASTCALL, "many buffers"},
    {"format_rows", (PyCFunction)(void (*)(void))py_format_rows, METH_FASTCALL, "CSV rows"},
    {"merge_fields", py_merge_fields, METH_O, "stats.merge_fields"},
    {"format_records", (PyCFunction)(void (*)(void))py_format_records, METH_FASTCALL, "merge_fields and format_rows"},
    {"records_many", (PyCFunction)(void (*)(void))py_records_many, METH_FASTCALL, "stats_many and Record.host"},
    {"record_read", (PyCFunction)(void (*)(void))py_record_read, METH_FASTCALL, "stats and Record in one call"},
    {"cache_entry", (PyCFunction)(void (*)(void))py_cache_entry, METH_FASTCALL, "a same-tensor cache entry"},
    {"tensor_record", (PyCFunction)(void (*)(void))py_tensor_record, METH_FASTCALL, "the engine's record of a CPU tensor"},
    {"use_exporter", py_use_exporter, METH_O, "read tensors through this DLPack exporter (None: their getters)"},
    {"exported", (PyCFunction)(void (*)(void))py_exported, METH_FASTCALL, "what an exporter gives for a tensor"},
    {"exporter", py_exporter, METH_NOARGS, "the exporter in use, or None"},
    {"use_view", py_use_view, METH_O, "read tensors through this DLPack exchange API's view (None: not)"},
    {"viewed", py_viewed, METH_O, "what the view in use gives for a tensor"},
    {"view", py_view, METH_NOARGS, "the exchange API in use, or None"},
    {"records_of", (PyCFunction)(void (*)(void))py_records_of, METH_FASTCALL, "record_many's common case"},
    {"not_on_host", py_not_on_host, METH_O, "the records to_host moves"},
    {"entries_again", (PyCFunction)(void (*)(void))py_entries_again, METH_FASTCALL, "StateListing.again's passes"},
    {"file_order", (PyCFunction)(void (*)(void))py_file_order, METH_FASTCALL, "monitor.weight_grad_rows"},
    {"edges_into", (PyCFunction)(void (*)(void))py_edges_into, METH_FASTCALL, "module._edges_into's walk"},
    {"forward_api", (PyCFunction)(void (*)(void))py_forward_api, METH_FASTCALL, "what CallHook calls"},
    {"forwards_replaced", py_forwards_replaced, METH_O, "ModuleHooks.replaced's pass"},
    {"graph_api", (PyCFunction)(void (*)(void))py_graph_api, METH_FASTCALL,
     "graph_api(register, edges_into, capi): what CallHook uses instead of torch's Python API (None x3: that API)"},
    {"_format_float", py_format_float, METH_O, "one float cell, as format_rows writes it"},
    {"dtypes", py_dtypes, METH_NOARGS, "bit mask of the dtype codes this build reduces"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_msprobe_monitor_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__msprobe_monitor_native(void) {
    if (PyType_Ready(&RecordType) < 0 || PyType_Ready(&NoteStateType) < 0 || PyType_Ready(&GradNoteType) < 0 ||
        PyType_Ready(&RecorderType) < 0 || PyType_Ready(&NodeHookType) < 0 ||
        PyType_Ready(&CallHookType) < 0 || PyType_Ready(&CallStateType) < 0 ||
        PyType_Ready(&BusyClockType) < 0 || PyType_Ready(&CallWrapperType) < 0)
        return NULL;
    str_active = PyUnicode_InternFromString("active");
    str_hooks_attr = PyUnicode_InternFromString("_post_accumulate_grad_hooks");
    str_forward = PyUnicode_InternFromString("forward");
    str_wrapped = PyUnicode_InternFromString("__wrapped__");
    if (str_active == NULL || str_hooks_attr == NULL || str_forward == NULL || str_wrapped == NULL)
        return NULL;
    const char *hook_dicts[4] = {"_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"};
    for (int i = 0; i < 4; i++)
        if ((str_module_hook_dicts[i] = PyUnicode_InternFromString(hook_dicts[i])) == NULL)
            return NULL;
    PyObject **interned[] = {&str_is_cpu, &str_dtype, &str_layout, &str_is_nested, &str_is_contiguous, &str_is_neg,
                          &str_numel, &str_data_ptr, &str_is_inference, &str_version, &str_next_functions,
                          &str_sequence_nr, &str_attached, &str_errors, &str_read, &str_records, &str_busy,
                          &str_report, &str_sums, &str_shape, &str_reshape, &str_read_sum, &str_pass, &str_scope, &str_nodes, &str_calls, &str_grad_fn, &str_is_view, &str_output_nr, &str_requires_grad,
                          &str_hook_graph, &str_outs_0, &str_in_ones, &str_add_out, &str_add_in, &str_grad_output_0,
                          &str_grad_input, &str_grad_input_site, &str_sum_numbers, &str_register_hook,
                          &str_register_prehook, &str_compiling_flag};
    const char *texts[] = {"is_cpu", "dtype", "layout", "is_nested", "is_contiguous", "is_neg", "numel", "data_ptr",
                           "is_inference", "_version", "next_functions", "_sequence_nr", "attached", "errors",
                           "_read", "_records", "busy", "report", "_sums", "shape", "reshape", "_read_sum", "_pass", "scope", "nodes", "_calls", "grad_fn", "_is_view", "output_nr", "requires_grad",
                           "_hook_graph", "outs_0", "_in_ones", "add_out", "add_in", "grad_output_0", "grad_input",
                           "grad_input_site", "_sum_numbers", "register_hook", "register_prehook",
                           "_is_compiling_flag"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
        if ((*interned[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    if ((_one_int = PyLong_FromLong(1)) == NULL)
        return NULL;
    pow10_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyTypeObject *types[] = {&RecordType, &NoteStateType, &GradNoteType, &RecorderType, &NodeHookType,
                             &CallHookType, &CallStateType, &BusyClockType, &CallWrapperType};
    const char *names[] = {"Record", "NoteState", "GradNote", "Recorder", "NodeHook", "CallHook", "CallState",
                           "BusyClock", "CallWrapper"};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
