/* The module monitor's graph hooks put on autograd nodes from C++.

   Through torch's Python API, putting a hook on a node (Node.register_hook,
   register_prehook) runs torch.autograd.function._register_hook in Python: a hook
   dictionary (an OrderedDict) and a RemovableHandle for each node, both objects of the
   garbage collector that live as long as the graph. A module call's hooks cost about
   2 us there, and the dictionaries make about a quarter of the objects that the
   collector moves to its oldest generation during a written step. Here the hook is added
   to the node directly (Node::add_post_hook / add_pre_hook): no dictionary, no handle.

   The hook object is the monitor's (module.py's _NodeHook or the extension's NodeHook):
   called with the GIL held, with the same arguments torch's Python hooks get (a post-hook
   (grad_inputs, grad_outputs), a pre-hook (grad_outputs,)), its result ignored (the
   monitor's hooks never replace a gradient). The monitor's hooks contain their own
   errors; an error that still comes out of one is counted (uncontained()) and cleared, so
   that it never reaches the backward pass.

   Compiled autograd asks each hook to hand it the Python object to call in the graph it
   traces (compiled_args): these hand it the monitor's hook, as torch's Python hooks hand
   theirs, so a compiled backward pass calls the same hook with the same arguments
   (compiled_requests() counts the requests).

   Only nodes that torch implements in C++ (THPCppFunction) are handled here; register()
   returns False for any other node (a custom autograd.Function's), and the monitor then
   uses the Python API. Built by graph_hooks.py against the headers of the torch that
   runs; nothing here is used where that build fails. */

#include <Python.h>

#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <typeindex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

std::atomic<long long> hooks_added{0};
std::atomic<long long> uncontained_errors{0};
std::atomic<long long> compiled_requests_seen{0};
std::atomic<long long> descriptions_given{0};

/* Which gradients a hook reads, where the kernel's extension says (set_reads: its
   NodeHook's slots): reads(hook, which, i) for which = 0 (a pre-hook's incoming gradients),
   1 (a post-hook's results), 2 (a post-hook's incoming gradients). The others are passed as
   None: a tensor's Python object costs its making and its freeing, and most nodes have
   three or four gradients of which the monitor reads one or two. */
int (*reads)(PyObject *hook, int which, Py_ssize_t i) = nullptr;

/* the gradients as a tuple of tensors, None where undefined or not read by `hook`: a new
   reference, or NULL */
PyObject *as_tuple(const variable_list &grads, PyObject *hook, int which) {
    PyObject *tuple = PyTuple_New(static_cast<Py_ssize_t>(grads.size()));
    if (tuple == nullptr)
        return nullptr;
    for (size_t i = 0; i < grads.size(); i++) {
        PyObject *item;
        if (grads[i].defined() && (reads == nullptr || reads(hook, which, static_cast<Py_ssize_t>(i)))) {
            item = THPVariable_Wrap(grads[i]);
            if (item == nullptr) {
                Py_DECREF(tuple);
                return nullptr;
            }
        } else {
            Py_INCREF(Py_None);
            item = Py_None;
        }
        PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
    }
    return tuple;
}

/* hook(*args) with the GIL held, each argument a gradient list; never raises */
void call_hook(PyObject *hook, const variable_list &first, const variable_list *second) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *a = as_tuple(first, hook, second == nullptr ? 0 : 1);
    PyObject *b = (a == nullptr || second == nullptr) ? nullptr : as_tuple(*second, hook, 2);
    PyObject *result = nullptr;
    if (a != nullptr && (second == nullptr || b != nullptr))
        result = second == nullptr ? PyObject_CallOneArg(hook, a) : PyObject_CallFunctionObjArgs(hook, a, b, nullptr);
    if (result == nullptr) {
        uncontained_errors.fetch_add(1, std::memory_order_relaxed);
        PyErr_Clear();
    }
    Py_XDECREF(result);
    Py_XDECREF(a);
    Py_XDECREF(b);
    PyGILState_Release(gil);
}

/* a reference held by a node, dropped with the GIL; leaked if Python has already gone
   (a graph freed at exit), as torch does for its own Python hooks */
void drop(PyObject *hook) {
    if (!Py_IsInitialized())
        return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(hook);
    PyGILState_Release(gil);
}

/* torch's C++ node behind a node object, or nullptr where it is not one of those */
Node *cpp_node(PyObject *obj) {
    if (!torch::autograd::THPCppFunction_Check(obj))
        return nullptr;
    return reinterpret_cast<torch::autograd::THPCppFunction *>(obj)->cdata.get();
}

struct PostHook final : torch::autograd::FunctionPostHook {
    PyObject *hook;
    explicit PostHook(PyObject *h) : hook(h) { Py_INCREF(h); }
    ~PostHook() override { drop(hook); }
    variable_list operator()(const variable_list &grad_inputs, const variable_list &grad_outputs) override {
        call_hook(hook, grad_inputs, &grad_outputs);
        return grad_inputs;
    }
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        compiled_requests_seen.fetch_add(1, std::memory_order_relaxed);
        Py_INCREF(hook); /* the SafePyObject takes this reference */
        args.add_post_hook(c10::SafePyObject(hook, getPyInterpreter()));
    }
};

struct PreHook final : torch::autograd::FunctionPreHook {
    PyObject *hook;
    explicit PreHook(PyObject *h) : hook(h) { Py_INCREF(h); }
    ~PreHook() override { drop(hook); }
    variable_list operator()(const variable_list &grad_outputs) override {
        call_hook(hook, grad_outputs, nullptr);
        return grad_outputs;
    }
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        compiled_requests_seen.fetch_add(1, std::memory_order_relaxed);
        Py_INCREF(hook); /* the SafePyObject takes this reference */
        args.add_pre_hook(c10::SafePyObject(hook, getPyInterpreter()));
    }
};

/* register(node, hook, post): True where the hook is on the node (a post-hook if post,
   else a pre-hook); False where the node is not one of torch's C++ nodes */
PyObject *register_hook(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "register(node, hook, post) takes 3 arguments");
        return nullptr;
    }
    int post = PyObject_IsTrue(args[2]);
    if (post < 0)
        return nullptr;
    Node *node = cpp_node(args[0]);
    if (node == nullptr)
        Py_RETURN_FALSE;
    try {
        if (post)
            node->add_post_hook(std::make_unique<PostHook>(args[1]));
        else
            node->add_pre_hook(std::make_unique<PreHook>(args[1]));
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return nullptr;
    }
    hooks_added.fetch_add(1, std::memory_order_relaxed);
    Py_RETURN_TRUE;
}

/* The nodes a walk has visited: a few in an array, a set past that. */
class Visited {
  public:
    bool contains(const Node *node) const {
        if (!set_.empty())
            return set_.count(node) != 0;
        return std::find(small_.begin(), small_.end(), node) != small_.end();
    }
    void add(const Node *node) {
        if (set_.empty() && small_.size() < 16) {
            small_.push_back(node);
            return;
        }
        if (set_.empty())
            set_.insert(small_.begin(), small_.end());
        set_.insert(node);
    }

  private:
    std::vector<const Node *> small_;
    std::unordered_set<const Node *> set_;
};


/* ------------------------------------------------------------------- the C API
   The kernel's extension (python_ext.c) runs a module's common call (one tensor in, one
   tensor out) in C; through these functions it takes the input's producer and the
   output's node, walks between them and puts its hooks on, with no Python object for any
   node: torch keeps a node's Python object as long as the node, and freeing it during the
   backward pass takes the GIL once a node. A node is passed as a pointer to the owning
   pointer torch's graph holds (an Edge's function, or a handle made by edge_of): valid
   while the graph is, so within one forward hook. The layout of GraphCApi is python_ext.c's
   msprobe_graph_capi_t. */

using NodePtr = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<torch::autograd::Edge &>().function)>>;

/* the Python type torch gives each C++ node type (the NodeHook's kind, as type(node) in
   module.py), learnt once per type from one node's Python object */
std::unordered_map<std::type_index, PyObject *> kinds;

/* whether a node is a custom autograd.Function's (torch's PyNode): by the type's name,
   since libtorch_python does not export PyNode's type information */
bool is_python_node(const Node *node) { return std::strcmp(typeid(*node).name(), "N5torch8autograd6PyNodeE") == 0; }

/* edge_of(tensor, &nr): a new handle on the node of `tensor`'s grad_fn and its output
   number, where the tensor is not a view and the node is one of torch's C++ nodes; NULL
   otherwise (the error set only where one was raised) */
void *edge_of(PyObject *tensor, long long *nr) {
    if (!THPVariable_Check(tensor))
        return nullptr;
    try {
        const at::Tensor &t = THPVariable_Unpack(tensor);
        if (t.is_view())
            return nullptr;
        const auto &fn = t.grad_fn();
        if (!fn || is_python_node(fn.get()))
            return nullptr;
        *nr = static_cast<long long>(t.output_nr());
        return new NodePtr(fn);
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return nullptr;
    }
}

void release(void *handle) { delete static_cast<NodePtr *>(handle); }

const NodePtr &owner(const void *node) { return *static_cast<const NodePtr *>(node); }

/* describe(node, &seq, &kind, &raw): the node's sequence number, the Python type of its
   node objects (borrowed), its address (to compare two nodes): 0, or -1 with the error set */
int describe(const void *node, unsigned long long *seq, PyObject **kind, const void **raw) {
    const NodePtr &ptr = owner(node);
    Node *n = ptr.get();
    *seq = n->sequence_nr();
    *raw = n;
    if (is_python_node(n)) {
        PyObject *obj = torch::autograd::functionToPyObject(ptr);
        if (obj == nullptr)
            return -1;
        *kind = reinterpret_cast<PyObject *>(Py_TYPE(obj));
        Py_DECREF(obj); /* a custom Function's node object lives as long as its node */
        return 0;
    }
    auto found = kinds.find(std::type_index(typeid(*n)));
    if (found == kinds.end()) {
        PyObject *obj = torch::autograd::functionToPyObject(ptr);
        if (obj == nullptr)
            return -1;
        PyObject *type = reinterpret_cast<PyObject *>(Py_TYPE(obj));
        Py_INCREF(type);
        Py_DECREF(obj);
        found = kinds.emplace(std::type_index(typeid(*n)), type).first;
    }
    *kind = found->second;
    return 0;
}

/* walk(roots, n_roots, target, target_nr, boundary, found, ctx): module.py's _edges_into on
   the C++ graph, from the nodes `roots`, depth first with a stack, each node once; found(ctx,
   node, e) called for each edge equal to (target, target_nr), in the order that loop finds
   them; a child is walked into where it is not a leaf's accumulator and its sequence number
   is at least `boundary`. No Python object is made. 0, or -1 with the error set (found's
   error, or the walk's). */
int walk(const void *const *roots, size_t n_roots, const void *target, long long target_nr, long long boundary,
         int (*found)(void *, const void *, Py_ssize_t), void *ctx) {
    const Node *goal = owner(target).get();
    std::vector<const NodePtr *> stack;
    for (size_t r = 0; r < n_roots; r++)
        stack.push_back(&owner(roots[r]));
    Visited visited;
    try {
        while (!stack.empty()) {
            const NodePtr *entry = stack.back();
            stack.pop_back();
            Node *node = entry->get();
            if (visited.contains(node))
                continue;
            visited.add(node);
            const auto &edges = node->next_edges();
            for (size_t e = 0; e < edges.size(); e++) {
                const torch::autograd::Edge &edge = edges[e];
                Node *child = edge.function.get();
                if (child == goal && static_cast<long long>(edge.input_nr) == target_nr) {
                    if (found(ctx, entry, static_cast<Py_ssize_t>(e)) < 0)
                        return -1;
                    continue;
                }
                if (child == nullptr || dynamic_cast<torch::autograd::AccumulateGrad *>(child) != nullptr)
                    continue;
                if ((boundary < 0 || child->sequence_nr() >= static_cast<uint64_t>(boundary)) && !visited.contains(child))
                    stack.push_back(&edge.function);
            }
        }
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return -1;
    }
    return 0;
}

/* put(node, hook, post): 1 with the hook on the node, 0 where the node is a custom
   Function's (the Python API then), -1 with the error set */
int put(const void *node, PyObject *hook, int post) {
    Node *n = owner(node).get();
    if (is_python_node(n))
        return 0;
    try {
        if (post)
            n->add_post_hook(std::make_unique<PostHook>(hook));
        else
            n->add_pre_hook(std::make_unique<PreHook>(hook));
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return -1;
    }
    hooks_added.fetch_add(1, std::memory_order_relaxed);
    return 1;
}

/* as_object(node): the node's Python object, a new reference (the Python API's fallbacks) */
PyObject *as_object(const void *node) {
    try {
        return torch::autograd::functionToPyObject(owner(node));
    } catch (const std::exception &exc) {
        PyErr_SetString(PyExc_RuntimeError, exc.what());
        return nullptr;
    }
}

void set_reads(int (*fn)(PyObject *, int, Py_ssize_t)) { reads = fn; }

/* buffer(tensor, &ptr, &n, &code): 1 with the first element's address, the element count
   and the kernel's dtype code (0 fp32, 1 bf16, 2 fp16) where `tensor` is a CPU tensor of
   one of those dtypes, strided, contiguous, not empty, with no negative bit and a storage;
   0 otherwise (the caller's other ways then look, and say what is wrong). Read from the
   tensor itself: torch's getters (is_neg() among them releases and takes the GIL again)
   and its DLPack exchange cost ten times as much. */
int buffer(PyObject *tensor, void **ptr, int64_t *n, int *code) {
    if (!THPVariable_Check(tensor))
        return 0;
    try {
        const at::Tensor &t = THPVariable_Unpack(tensor);
        if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || t.is_nested() || t.is_neg() ||
            !t.has_storage())
            return 0;
        switch (t.scalar_type()) {
        case at::kFloat: *code = 0; break;
        case at::kBFloat16: *code = 1; break;
        case at::kHalf: *code = 2; break;
        default: return 0;
        }
        if (!t.is_contiguous())
            return 0;
        int64_t count = t.numel();
        const void *data = count > 0 ? t.const_data_ptr() : nullptr;
        if (data == nullptr)
            return 0;
        *ptr = const_cast<void *>(data);
        *n = count;
        descriptions_given.fetch_add(1, std::memory_order_relaxed);
        return 1;
    } catch (const std::exception &) {
        return 0;
    }
}

struct GraphCApi {
    unsigned int version;
    void (*set_reads)(int (*)(PyObject *, int, Py_ssize_t));
    void *(*edge_of)(PyObject *, long long *);
    void (*release)(void *);
    int (*describe)(const void *, unsigned long long *, PyObject **, const void **);
    int (*walk)(const void *const *, size_t, const void *, long long, long long,
                int (*)(void *, const void *, Py_ssize_t), void *);
    int (*put)(const void *, PyObject *, int);
    PyObject *(*as_object)(const void *);
    int (*buffer)(PyObject *, void **, int64_t *, int *);
};

const GraphCApi capi = {4, set_reads, edge_of, release, describe, walk, put, as_object, buffer};

/* The owning pointer behind one of torch's C++ node objects (a C API node), or nullptr */
const void *cpp_owner(PyObject *obj) {
    if (!torch::autograd::THPCppFunction_Check(obj))
        return nullptr;
    return &reinterpret_cast<torch::autograd::THPCppFunction *>(obj)->cdata;
}

int append_found(void *ctx, const void *node, Py_ssize_t e) {
    PyObject *obj = as_object(node); /* the object torch keeps for the node: a root's is the one given */
    PyObject *pair = obj == nullptr ? nullptr : Py_BuildValue("(Nn)", obj, e);
    int failed = pair == nullptr || PyList_Append(static_cast<PyObject *>(ctx), pair) < 0;
    Py_XDECREF(pair);
    return failed ? -1 : 0;
}

/* edges_into(target, roots, boundary) -> [(node, edge index), ...]: walk() on node objects
   (module.py's _edges_into in C++), or None where a node given is not one of torch's C++
   nodes (the caller then walks through the Python API). */
PyObject *edges_into(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "edges_into(target: (node, nr), roots: list, boundary)");
        return nullptr;
    }
    const void *target = cpp_owner(PyTuple_GET_ITEM(args[0], 0));
    long long target_nr = PyLong_AsLongLong(PyTuple_GET_ITEM(args[0], 1));
    long long boundary = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return nullptr;
    if (target == nullptr)
        Py_RETURN_NONE;
    std::vector<const void *> roots;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[1]); i++) {
        const void *root = cpp_owner(PyList_GET_ITEM(args[1], i));
        if (root == nullptr)
            Py_RETURN_NONE;
        roots.push_back(root);
    }
    PyObject *found = PyList_New(0);
    if (found == nullptr || walk(roots.data(), roots.size(), target, target_nr, boundary, append_found, found) < 0) {
        Py_XDECREF(found);
        return nullptr;
    }
    return found;
}

/* buffer(tensor) -> (address, count, code) or None: the C API's buffer (for the self-test) */
PyObject *py_buffer(PyObject *, PyObject *tensor) {
    void *ptr = nullptr;
    int64_t n = 0;
    int code = 0;
    if (!buffer(tensor, &ptr, &n, &code))
        Py_RETURN_NONE;
    return Py_BuildValue("(NLi)", PyLong_FromVoidPtr(ptr), static_cast<long long>(n), code);
}

PyObject *counter(std::atomic<long long> &value) { return PyLong_FromLongLong(value.load()); }
PyObject *hooks(PyObject *, PyObject *) { return counter(hooks_added); }
PyObject *uncontained(PyObject *, PyObject *) { return counter(uncontained_errors); }
PyObject *compiled_requests(PyObject *, PyObject *) { return counter(compiled_requests_seen); }
PyObject *descriptions(PyObject *, PyObject *) { return counter(descriptions_given); }

PyMethodDef methods[] = {
    {"register", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_hook)), METH_FASTCALL,
     "register(node, hook, post): put hook on one of torch's C++ nodes; False for other nodes"},
    {"edges_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(edges_into)), METH_FASTCALL,
     "edges_into(target, roots, boundary): module.py's _edges_into on torch's C++ nodes; None for other nodes"},
    {"buffer", py_buffer, METH_O, "buffer(tensor) -> (address, count, dtype code) where the kernel reads it, or None"},
    {"descriptions", descriptions, METH_NOARGS, "tensors described through the C API's buffer in this process"},
    {"hooks", hooks, METH_NOARGS, "hooks put on nodes by this library in this process"},
    {"uncontained", uncontained, METH_NOARGS, "errors that came out of a hook (cleared, not raised)"},
    {"compiled_requests", compiled_requests, METH_NOARGS,
     "times compiled autograd asked one of these hooks to register itself (they do not)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_msprobe_monitor_graph", nullptr, -1, methods};

} // namespace

PyMODINIT_FUNC PyInit__msprobe_monitor_graph(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr)
        return nullptr;
    PyObject *api = PyCapsule_New(const_cast<GraphCApi *>(&capi), "msprobe_monitor_graph.capi", nullptr);
    if (api == nullptr || PyModule_AddObject(m, "capi", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
