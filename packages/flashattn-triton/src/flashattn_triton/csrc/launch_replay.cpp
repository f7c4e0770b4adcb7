// flash_attention's repeated eager calls as a C++ autograd node (``cpp_launch.py``).
//
// The first call of an input layout runs the Python launchers, which record their kernel
// launches (``fastlaunch``); ``cpp_plans.py`` turns that record into launch descriptions and
// registers them here. Later calls with the same layouts are found here by their layouts and
// launch the compiled kernels with cuLaunchKernelEx, forward and backward, with no Python
// per backward and a few checks per forward. Kernel parameters are laid out as Triton 3.6's
// generated launcher lays them out: one slot per non-constexpr argument, TMA descriptors as
// filled 128-byte CUtensorMaps, then the two scratch pointers.
//
// Only libtorch is linked: the CUDA driver is opened at run time, and the current device and
// stream come through c10's device-generic interface, so no CUDA toolkit is needed to build.
// cuda.h (types only) comes from Triton's bundled headers.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/Context.h>
#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

// Calls served in C++, and backward calls handed to Python (``counters()``: tests, debugging).
std::atomic<int64_t> n_forward{0}, n_backward{0}, n_fallback{0};

typedef CUresult (*LaunchEx)(const CUlaunchConfig*, CUfunction, void**, void**);

LaunchEx launch_ex() {
  static LaunchEx fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY);
    TORCH_CHECK(lib, "flashattn_triton cpp_launch: cannot open libcuda.so.1");
    auto f = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    TORCH_CHECK(f, "flashattn_triton cpp_launch: no cuLaunchKernelEx in libcuda.so.1");
    return f;
  }();
  return fn;
}

struct Desc {
  int64_t offset;  // byte offset of the 128-byte CUtensorMap in the parameter blob
  int64_t buffer;  // which address it describes
  py::object fill; // base address -> bytes(128) (cache misses only, under the GIL)
  std::mutex m;    // guards cache; never held while taking the GIL
  std::unordered_map<uint64_t, std::string> cache;
};

struct Launch {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  int num_warps = 4, num_ctas = 1, shared = 0;
  bool coop = false, pdl = false;
  std::string blob;                  // every parameter's bytes, each at its offset
  std::vector<int64_t> offsets;      // parameter i starts at blob[offsets[i]]
  std::vector<std::pair<int64_t, int64_t>> pointers;  // (byte offset, address index)
  std::vector<std::unique_ptr<Desc>> descs;
};

struct Plan {
  std::vector<std::unique_ptr<Launch>> launches;
};

struct BwdPlan {
  Plan plan;
  std::vector<int64_t> stats_shape;
  int64_t delta_offset = 0;
  bool onepass = false;
};

struct Entry {
  Plan fwd;
  double scale = 1.0;
  bool causal = false;
  std::mutex lock;  // guards bwd (the device thread and the calling thread may both look)
  std::unordered_map<std::string, std::shared_ptr<BwdPlan>> bwd;
  py::object bwd_fallback;  // (entry id, do, q, k, v, o, lse) -> (dq, dk, dv)
};

// Leaked on purpose: the entries hold Python objects, which must not be released after the
// interpreter has shut down (static destructors run then).
std::vector<std::unique_ptr<Entry>>& entries() {
  static auto* all = new std::vector<std::unique_ptr<Entry>>();
  return *all;
}

std::mutex& entries_lock() {
  static std::mutex m;
  return m;
}

// Entries by the forward's layouts (fwd_key), so that a repeated call is found in C++.
std::unordered_map<std::string, int64_t>& fwd_index() {
  static auto* index = new std::unordered_map<std::string, int64_t>();
  return *index;
}

// Entries are never removed, so the pointer stays valid after the lock is released.
Entry& entry(int64_t id) {
  std::lock_guard<std::mutex> guard(entries_lock());
  return *entries().at(id);
}

// One aligned parameter area per thread (CUtensorMap parameters are 64-byte aligned types).
uint8_t* scratch_area(size_t bytes) {
  thread_local std::vector<uint8_t> area;
  if (area.size() < bytes + 128) area.resize(bytes + 128);
  auto p = reinterpret_cast<uintptr_t>(area.data());
  return reinterpret_cast<uint8_t*>((p + 127) & ~uintptr_t(127));
}

void run_launch(Launch& L, const std::vector<uint64_t>& addr, CUstream stream) {
  uint8_t* area = scratch_area(L.blob.size());
  std::memcpy(area, L.blob.data(), L.blob.size());
  for (auto& [off, idx] : L.pointers) std::memcpy(area + off, &addr[idx], 8);
  for (auto& d : L.descs) {
    uint64_t base = addr[d->buffer];
    bool hit = false;
    {
      std::lock_guard<std::mutex> guard(d->m);
      auto it = d->cache.find(base);
      if (it != d->cache.end()) {
        std::memcpy(area + d->offset, it->second.data(), 128);
        hit = true;
      }
    }
    if (hit) continue;
    std::string bytes;
    {
      py::gil_scoped_acquire gil;
      bytes = d->fill(base).cast<std::string>();
    }
    TORCH_CHECK(bytes.size() == 128, "flashattn_triton cpp_launch: a tensor map is 128 bytes");
    std::memcpy(area + d->offset, bytes.data(), 128);
    std::lock_guard<std::mutex> guard(d->m);
    if (d->cache.size() >= 64) d->cache.clear();
    d->cache.emplace(base, std::move(bytes));
  }
  std::vector<void*> params(L.offsets.size());
  for (size_t i = 0; i < L.offsets.size(); ++i) params[i] = area + L.offsets[i];
  CUlaunchAttribute attrs[4];
  int n = 0;
  if (L.pdl) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (L.coop) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[n].value.cooperative = 1;
    ++n;
  }
  if (L.num_ctas != 1) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[n].value.clusterDim.x = L.num_ctas;
    attrs[n].value.clusterDim.y = 1;
    attrs[n].value.clusterDim.z = 1;
    ++n;
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attrs[n].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
    ++n;
  }
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = L.grid[0] * L.num_ctas;
  cfg.gridDimY = L.grid[1];
  cfg.gridDimZ = L.grid[2];
  cfg.blockDimX = 32 * L.num_warps;
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = L.shared;
  cfg.hStream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  if (L.grid[0] * L.grid[1] * L.grid[2] == 0) return;
  CUresult r = launch_ex()(&cfg, reinterpret_cast<CUfunction>(L.function), params.data(), nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "flashattn_triton cpp_launch: cuLaunchKernelEx failed with ", int(r));
}

void run_plan(Plan& p, const std::vector<uint64_t>& addr, const at::Tensor& like) {
  if (p.launches.empty()) return;  // (the CPU tests of the autograd plumbing)
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  auto stream = reinterpret_cast<CUstream>(impl->getStream(like.device()).native_handle());
  for (auto& L : p.launches) run_launch(*L, addr, stream);
}

// Whether q's device is the current one (the kernels were loaded in its context).
bool on_current_device(const at::Tensor& q) {
  if (!q.is_cuda()) return true;  // (the CPU tests: plans without launches)
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getDevice().index() == q.get_device();
}

// The layout of a tensor as the backward's plan table keys it.
std::string layout_key(const at::Tensor& t) {
  std::string key;
  key.reserve(80);
  key += std::to_string(static_cast<int>(t.scalar_type()));
  key += t.data_ptr() != nullptr && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) ? "u" : "a";
  for (int64_t i = 0; i < t.dim(); ++i) {
    key += ':';
    key += std::to_string(t.size(i));
    key += '/';
    key += std::to_string(t.stride(i));
  }
  key += '@';
  key += std::to_string(t.get_device());
  return key;
}

// The forward's key: the three layouts, causal, the window when there is one, and the scale
// when it is not the default 1/sqrt(d) (0: the default; Python's 1.0 / math.sqrt(d) is the
// same correctly rounded double), exactly, as a hexadecimal float.
std::string fwd_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                    int64_t window_left, int64_t window_right, double scale) {
  std::string key = layout_key(q) + "|" + layout_key(k) + "|" + layout_key(v) + (causal ? "|c" : "|n");
  if (window_left != -1 || window_right != -1)
    key += "|w" + std::to_string(window_left) + "," + std::to_string(window_right);
  if (scale != 0.0 && scale != 1.0 / std::sqrt(static_cast<double>(q.size(-1)))) {
    char text[48];
    std::snprintf(text, sizeof text, "|s%a", scale);
    key += text;
  }
  return key;
}

bool distinct_and_aligned(const std::vector<uint64_t>& addr, size_t first_output) {
  for (size_t i = first_output; i < addr.size(); ++i)
    if (addr[i] & 15) return false;
  for (size_t i = 0; i < addr.size(); ++i)
    for (size_t j = i + 1; j < addr.size(); ++j)
      if (addr[i] == addr[j]) return false;
  return true;
}

uint64_t ptr(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// 3-D inputs are replayed as the 4-D views the Python path launches on (``autograd.as_bhnd``):
// (H, N, d) with grouped k/v heads as (1, H, N, d), else (B, N, d) as (B, 1, N, d). The dim
// those views insert: -1 for 4-D inputs (no views), 0 or 1 for 3-D ones, kOtherRank else.
constexpr int64_t kOtherRank = -3;

int64_t inserted_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() == 4 && k.dim() == 4 && v.dim() == 4) return -1;
  if (q.dim() == 3 && k.dim() == 3 && v.dim() == 3) return q.size(0) != k.size(0) ? 0 : 1;
  return kOtherRank;
}

at::Tensor as4(const at::Tensor& t, int64_t dim) {
  return dim < 0 || !t.defined() ? t : t.unsqueeze(dim);
}

// The inverse of ``as4``: a 4-D result in the caller's rank.
at::Tensor as_given(const at::Tensor& t, int64_t dim) {
  return dim < 0 || !t.defined() ? t : t.squeeze(dim);
}

// The backward of entry e replayed for these tensors, if dO's layout has a plan that may run
// here (into ``out``: dq, dk, dv); false otherwise, for the caller to hand to Python.
bool replay_backward(Entry& e, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                     tensor_list& out) {
  std::shared_ptr<BwdPlan> plan;
  bool deterministic = at::globalContext().deterministicAlgorithms();
  if (dout.defined() && dout.stride(-1) == 1) {
    std::string key = layout_key(dout);
    std::lock_guard<std::mutex> guard(e.lock);
    auto it = e.bwd.find(key);
    if (it != e.bwd.end()) plan = it->second;
  }
  if (!plan || (plan->onepass && deterministic)) return false;
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  std::vector<uint64_t> addr = {ptr(q), ptr(k), ptr(v), ptr(dout), ptr(o), ptr(lse),
                                ptr(dq), ptr(dk), ptr(dv)};
  at::Tensor stats = at::empty(plan->stats_shape, lse.options());
  addr.push_back(ptr(stats));
  addr.push_back(ptr(stats) + plan->delta_offset);
  at::Tensor acc;
  if (plan->onepass) {
    acc = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    addr.push_back(ptr(acc));
  }
  if (!distinct_and_aligned(addr, 6)) return false;
  run_plan(plan->plan, addr, q);
  if (plan->onepass) dq.copy_(acc);
  n_backward.fetch_add(1, std::memory_order_relaxed);
  out = {dq, dk, dv};
  return true;
}

class FlashFn : public torch::autograd::Function<FlashFn> {
 public:
  // ``dim``: see ``inserted_dim`` (the plans launch on 4-D views of 3-D inputs). Outputs: o,
  // and with ``with_lse`` the lse too (not differentiable, as the Python path's).
  static tensor_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v,
                             int64_t id, int64_t dim, bool with_lse) {
    Entry& e = entry(id);
    at::Tensor q4 = as4(q, dim);
    at::Tensor o4 = at::empty_like(q4);
    at::Tensor lse = at::empty({q4.size(0), q4.size(1), q4.size(2)}, q.options().dtype(at::kFloat));
    std::vector<uint64_t> addr = {ptr(q), ptr(k), ptr(v), ptr(o4), ptr(lse)};
    TORCH_CHECK(distinct_and_aligned(addr, 3), "flashattn_triton cpp_launch: buffers alias or are misaligned");
    run_plan(e.fwd, addr, q4);
    n_forward.fetch_add(1, std::memory_order_relaxed);
    at::Tensor o = as_given(o4, dim);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["id"] = id;
    ctx->saved_data["dim"] = dim;
    if (!with_lse) return {o};
    at::Tensor lse_given = as_given(lse, dim);
    ctx->mark_non_differentiable({lse_given});
    return {o, lse_given};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    int64_t id = ctx->saved_data["id"].toInt();
    Entry& e = entry(id);
    int64_t dim = ctx->saved_data["dim"].toInt();
    auto saved = ctx->get_saved_variables();
    at::Tensor q = as4(saved[0], dim), k = as4(saved[1], dim), v = as4(saved[2], dim);
    at::Tensor o = as4(saved[3], dim), lse = saved[4];
    at::Tensor dout = as4(grads[0], dim);
    c10::OptionalDeviceGuard device_guard;
    if (q.is_cuda()) device_guard.reset_device(q.device());
    tensor_list g;
    if (!replay_backward(e, dout, q, k, v, o, lse, g)) {
      n_fallback.fetch_add(1, std::memory_order_relaxed);
      py::gil_scoped_acquire gil;  // first backward of this dO layout, or one that cannot replay
      py::tuple r = e.bwd_fallback(id, dout, q, k, v, o, lse);
      g = {r[0].cast<at::Tensor>(), r[1].cast<at::Tensor>(), r[2].cast<at::Tensor>()};
    }
    return {as_given(g[0], dim), as_given(g[1], dim), as_given(g[2], dim), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

std::unique_ptr<Launch> make_launch(py::dict d) {
  auto L = std::make_unique<Launch>();
  L->function = d["function"].cast<uint64_t>();
  auto g = d["grid"].cast<std::vector<int64_t>>();
  for (int i = 0; i < 3; ++i) L->grid[i] = static_cast<unsigned>(g.at(i));
  L->num_warps = d["num_warps"].cast<int>();
  L->num_ctas = d["num_ctas"].cast<int>();
  L->shared = d["shared"].cast<int>();
  L->coop = d["coop"].cast<bool>();
  L->pdl = d["pdl"].cast<bool>();
  L->blob = d["blob"].cast<std::string>();
  L->offsets = d["offsets"].cast<std::vector<int64_t>>();
  L->pointers = d["pointers"].cast<std::vector<std::pair<int64_t, int64_t>>>();
  for (auto item : d["descs"].cast<py::list>()) {
    auto t = item.cast<py::tuple>();
    auto desc = std::make_unique<Desc>();
    desc->offset = t[0].cast<int64_t>();
    desc->buffer = t[1].cast<int64_t>();
    desc->fill = t[2].cast<py::object>();
    L->descs.push_back(std::move(desc));
  }
  return L;
}

void fill_plan(Plan& p, py::list launches) {
  for (auto d : launches) p.launches.push_back(make_launch(d.cast<py::dict>()));
}

}  // namespace

int64_t add_entry(py::list fwd_launches, py::object bwd_fallback) {
  auto e = std::make_unique<Entry>();
  fill_plan(e->fwd, fwd_launches);
  e->bwd_fallback = bwd_fallback;
  std::lock_guard<std::mutex> guard(entries_lock());
  entries().push_back(std::move(e));
  return static_cast<int64_t>(entries().size()) - 1;
}

void add_backward(int64_t id, const std::string& key, py::list launches,
                  std::vector<int64_t> stats_shape, int64_t delta_offset, bool onepass) {
  auto plan = std::make_shared<BwdPlan>();
  fill_plan(plan->plan, launches);
  plan->stats_shape = std::move(stats_shape);
  plan->delta_offset = delta_offset;
  plan->onepass = onepass;
  Entry& e = entry(id);
  std::lock_guard<std::mutex> guard(e.lock);
  e.bwd[key] = plan;
}

at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t id) {
  int64_t dim = inserted_dim(q, k, v);
  TORCH_CHECK(dim != kOtherRank, "flashattn_triton cpp_launch: q, k, v must all be 3-D or 4-D");
  return FlashFn::apply(q, k, v, id, dim, false)[0];
}

// The index's mark for a layout whose calls cannot be described (kept on the Python path).
constexpr int64_t kRefused = -1;

void index_entry(const std::string& key, int64_t id) {
  std::lock_guard<std::mutex> guard(entries_lock());
  fwd_index()[key] = id;
}

void refuse(const std::string& key) { index_entry(key, kRefused); }

// Drop the refused marks (entries stay): bounds the index when refused shapes keep changing.
int64_t forget_refused() {
  std::lock_guard<std::mutex> guard(entries_lock());
  int64_t n = 0;
  for (auto it = fwd_index().begin(); it != fwd_index().end();) {
    if (it->second == kRefused) {
      it = fwd_index().erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

// The entry of a forward key: its id, kRefused, or kUnknown.
constexpr int64_t kUnknown = -2;

int64_t lookup(const std::string& key) {
  std::lock_guard<std::mutex> guard(entries_lock());
  auto it = fwd_index().find(key);
  return it == fwd_index().end() ? kUnknown : it->second;
}

// The entry a call on these inputs may replay: its id; kRefused for refused layouts; kUnknown
// for unknown layouts, for ranks other than 3 and 4, and for calls the replays cannot take
// here (another current device, inputs sharing an address, e.g. q is k: the Python path
// refuses those too). ``dim``: ``inserted_dim`` (3-D inputs are keyed by their 4-D views).
int64_t replayable_entry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool causal, int64_t window_left, int64_t window_right, double scale,
                         int64_t dim) {
  if (dim == kOtherRank) return kUnknown;
  int64_t id;
  if (dim < 0) {
    id = lookup(fwd_key(q, k, v, causal, window_left, window_right, scale));
  } else {
    at::NoGradGuard no_grad;  // (views for the key only)
    id = lookup(fwd_key(as4(q, dim), as4(k, dim), as4(v, dim), causal, window_left,
                        window_right, scale));
  }
  if (id < 0) return id;
  bool here = on_current_device(q) && distinct_and_aligned({ptr(q), ptr(k), ptr(v)}, 3);
  return here ? id : kUnknown;
}

// The call through the C++ node if its layouts have an entry (o; with ``return_lse`` (o, lse));
// False if they were refused (the caller's Python path, not offered to ``learn`` again); None
// if they are unknown or not replayable here (the Python path).
py::object attention_if_known(at::Tensor q, at::Tensor k, at::Tensor v, bool causal,
                              int64_t window_left, int64_t window_right, double scale,
                              bool return_lse) {
  int64_t dim = inserted_dim(q, k, v);
  int64_t id = replayable_entry(q, k, v, causal, window_left, window_right, scale, dim);
  if (id == kRefused) return py::bool_(false);
  if (id < 0) return py::none();
  tensor_list out = FlashFn::apply(q, k, v, id, dim, return_lse);
  if (return_lse) return py::make_tuple(out[0], out[1]);
  return py::cast(out[0]);
}

// Compiled graphs' opaque ops (``cpp_launch.op_forward`` / ``op_backward``): the same
// entries without an autograd node. (o, lse) if the layouts have an entry; False if they were
// refused; None if unknown or not replayable here (the caller's Python launchers).
py::object forward_if_known(at::Tensor q, at::Tensor k, at::Tensor v, bool causal,
                            int64_t window_left, int64_t window_right, double scale) {
  int64_t dim = inserted_dim(q, k, v);
  int64_t id = replayable_entry(q, k, v, causal, window_left, window_right, scale, dim);
  if (id == kRefused) return py::bool_(false);
  if (id < 0) return py::none();
  Entry& e = entry(id);
  at::Tensor q4 = as4(q, dim);
  at::Tensor o4 = at::empty_like(q4);
  at::Tensor lse = at::empty({q4.size(0), q4.size(1), q4.size(2)}, q.options().dtype(at::kFloat));
  std::vector<uint64_t> addr = {ptr(q), ptr(k), ptr(v), ptr(o4), ptr(lse)};
  if (!distinct_and_aligned(addr, 3)) return py::none();
  run_plan(e.fwd, addr, q4);
  n_forward.fetch_add(1, std::memory_order_relaxed);
  return py::make_tuple(as_given(o4, dim), as_given(lse, dim));
}

// (dq, dk, dv) if the forward's layouts have an entry whose plan for dO's layout may run here;
// else the entry's id (negative: none), for registering the backward that Python then runs.
py::object backward_if_known(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v,
                             at::Tensor o, at::Tensor lse, bool causal, int64_t window_left,
                             int64_t window_right, double scale) {
  int64_t id = lookup(fwd_key(q, k, v, causal, window_left, window_right, scale));
  if (id < 0 || !on_current_device(q)) return py::int_(id < 0 ? id : kUnknown);
  tensor_list g;
  if (!replay_backward(entry(id), dout, q, k, v, o, lse, g)) return py::int_(id);
  return py::make_tuple(g[0], g[1], g[2]);
}

// Compiled graphs' opaque ops ``fwd_launch`` / ``bwd_launch``, implemented here for one
// dispatch key (``serve_ops``): a replayable call goes from the dispatcher to these functions
// with no Python at all; every other call (the option off, unknown or refused layouts, a dO
// layout without a plan) goes to the Python launchers ``cpp_launch.op_forward`` /
// ``op_backward``, which also register new layouts. Leaked like the entries.
std::atomic<bool> ops_serving{false};

struct OpFallbacks {
  py::object fwd, bwd;
};

OpFallbacks& op_fallbacks() {
  static auto* f = new OpFallbacks();
  return *f;
}

std::tuple<at::Tensor, at::Tensor> fwd_op(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, bool causal, double scale,
                                          int64_t window_left, int64_t window_right) {
  if (ops_serving.load(std::memory_order_relaxed) && q.dim() == 4 && k.dim() == 4 &&
      v.dim() == 4) {
    int64_t id = replayable_entry(q, k, v, causal, window_left, window_right, scale, -1);
    if (id >= 0) {
      at::Tensor o = at::empty_like(q);
      at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
      std::vector<uint64_t> addr = {ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse)};
      if (distinct_and_aligned(addr, 3)) {
        run_plan(entry(id).fwd, addr, q);
        n_forward.fetch_add(1, std::memory_order_relaxed);
        return {o, lse};
      }
    }
  }
  py::gil_scoped_acquire gil;
  py::tuple r = op_fallbacks().fwd(q, k, v, causal, scale, window_left, window_right);
  return {r[0].cast<at::Tensor>(), r[1].cast<at::Tensor>()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& o, const at::Tensor& lse, bool causal, double scale, int64_t window_left,
    int64_t window_right) {
  if (ops_serving.load(std::memory_order_relaxed) && q.dim() == 4 && on_current_device(q)) {
    int64_t id = lookup(fwd_key(q, k, v, causal, window_left, window_right, scale));
    tensor_list g;
    if (id >= 0 && replay_backward(entry(id), dout, q, k, v, o, lse, g)) return {g[0], g[1], g[2]};
  }
  py::gil_scoped_acquire gil;
  py::tuple r = op_fallbacks().bwd(dout, q, k, v, o, lse, causal, scale, window_left,
                                   window_right);
  return {r[0].cast<at::Tensor>(), r[1].cast<at::Tensor>(), r[2].cast<at::Tensor>()};
}

// Register ``fwd_op`` / ``bwd_op`` as the kernels of ``<ns>::fwd_launch`` / ``bwd_launch`` for
// ``dispatch_key`` (once per namespace and key; later calls only replace the fallbacks, the
// Python launchers of every call these do not replay).
void serve_ops(const std::string& ns, const std::string& dispatch_key, py::object fwd_fallback,
               py::object bwd_fallback) {
  static auto* libraries = new std::unordered_map<std::string, std::unique_ptr<torch::Library>>();
  op_fallbacks().fwd = fwd_fallback;
  op_fallbacks().bwd = bwd_fallback;
  std::string name = ns + "/" + dispatch_key;
  if (libraries->count(name)) return;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                              c10::parseDispatchKey(dispatch_key), __FILE__,
                                              __LINE__);
  lib->impl("fwd_launch", TORCH_FN(fwd_op));
  lib->impl("bwd_launch", TORCH_FN(bwd_op));
  (*libraries)[name] = std::move(lib);
}

// Whether ``fwd_op`` / ``bwd_op`` replay (``Options.cpp_launch_compiled`` and the C++ path on);
// off, they hand every call to the Python launchers.
void set_ops_serving(bool on) { ops_serving.store(on, std::memory_order_relaxed); }

// After an options or tile-table change: forget every layout (entries stay allocated: nodes of
// live graphs may still point at them, and their backward plans are dropped too).
void reset() {
  std::lock_guard<std::mutex> guard(entries_lock());
  fwd_index().clear();
  for (auto& e : entries()) {
    std::lock_guard<std::mutex> g(e->lock);
    e->bwd.clear();
  }
}

py::dict counters() {
  py::dict d;
  d["forward"] = n_forward.load();
  d["backward"] = n_backward.load();
  d["backward_fallback"] = n_fallback.load();
  return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("counters", &counters);
  m.def("reset", &reset);
  m.def("add_entry", &add_entry);
  m.def("add_backward", &add_backward);
  m.def("attention", &attention);
  m.def("layout_key", &layout_key);
  m.def("fwd_key", &fwd_key, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"),
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("scale") = 0.0);
  m.def("index_entry", &index_entry);
  m.def("forward_if_known", &forward_if_known, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("causal"), py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("scale") = 0.0);
  m.def("backward_if_known", &backward_if_known, py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("causal"),
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("scale") = 0.0);
  m.def("serve_ops", &serve_ops);
  m.def("set_ops_serving", &set_ops_serving);
  m.def("refuse", &refuse);
  m.def("forget_refused", &forget_refused);
  m.def("attention_if_known", &attention_if_known, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("causal"), py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("scale") = 0.0, py::arg("return_lse") = false);
}
