// rlk_core._C: launches the ahead-of-time built Triton cubins of rlk_core.aot (backend rlk.cuda).
//
// The driver API is reached through dlopen("libcuda.so.1") + dlsym, as Triton's own launcher does, so the extension
// links against nothing but torch and builds on a machine without a GPU driver. Per variant (one cubin of the
// manifest) `load` is called once per device: cuModuleLoadData, cuModuleGetFunction, dynamic shared memory above
// 48 KiB opted in exactly as Triton 3.6's loadBinary does, and the parameter list kept as a type code string:
//   'p' pointer, 'i' int32, 'l' int64, 'f' fp32, 'D' a TMA descriptor: the CUtensorMap encoded (as Triton 3.6's
//       fill_tma_descriptor does, from the manifest's tensordesc_meta) followed by its shape (i32 x2) and strides
//       (i64 x2, in elements),
// then the two scratch pointers Triton 3.6 appends (null: variants with scratch are not built). A launch goes to
// torch's current stream of its device with cuLaunchKernelEx, with the programmatic-stream-serialization attribute
// for launch_pdl variants. Encoded descriptors are kept by their encoding's inputs (see DescKey).
//
// `launch(handle, grid, *args)` makes one launch from Python (rlk_core.ops._cuda.Run). `run_program(record, *inputs)`
// runs a decided call (rlk_core.ops._cuda.Decide.program): it allocates the buffers the record names, makes each
// launch with its arguments as the record gives them (inputs and buffers at byte offsets, held addresses, numbers,
// descriptors) and returns the buffers it names — an op call in one C++ call. `fast` repeats a whole op call:
// the signature of its arguments, the readback count and the program (see "the fast path" below).

#include <torch/extension.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

struct Driver {
  decltype(&cuModuleLoadData) moduleLoadData = nullptr;
  decltype(&cuModuleGetFunction) moduleGetFunction = nullptr;
  decltype(&cuFuncGetAttribute) funcGetAttribute = nullptr;
  decltype(&cuFuncSetAttribute) funcSetAttribute = nullptr;
  decltype(&cuFuncSetCacheConfig) funcSetCacheConfig = nullptr;
  decltype(&cuDeviceGetAttribute) deviceGetAttribute = nullptr;
  decltype(&cuLaunchKernelEx) launchKernelEx = nullptr;
  decltype(&cuTensorMapEncodeTiled) tensorMapEncodeTiled = nullptr;
  decltype(&cuGetErrorString) getErrorString = nullptr;
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(h != nullptr, "rlk_core._C: cannot dlopen libcuda.so.1: ", dlerror());
#define RLK_SYM(field, name)                                                   \
  d.field = reinterpret_cast<decltype(d.field)>(dlsym(h, name));               \
  TORCH_CHECK(d.field != nullptr, "rlk_core._C: libcuda.so.1 lacks ", name);
    RLK_SYM(moduleLoadData, "cuModuleLoadData");
    RLK_SYM(moduleGetFunction, "cuModuleGetFunction");
    RLK_SYM(funcGetAttribute, "cuFuncGetAttribute");
    RLK_SYM(funcSetAttribute, "cuFuncSetAttribute");
    RLK_SYM(funcSetCacheConfig, "cuFuncSetCacheConfig");
    RLK_SYM(deviceGetAttribute, "cuDeviceGetAttribute");
    RLK_SYM(launchKernelEx, "cuLaunchKernelEx");
    RLK_SYM(tensorMapEncodeTiled, "cuTensorMapEncodeTiled");
    RLK_SYM(getErrorString, "cuGetErrorString");
#undef RLK_SYM
  });
  return d;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* s = nullptr;
  driver().getErrorString(r, &s);
  TORCH_CHECK(false, "rlk_core._C: ", what, " failed: ", s ? s : "unknown error", " (", int(r), ")");
}

struct DescMeta {
  uint32_t block[2];  // the box in the manifest's order (outer, inner)
  int swizzle, elem_size, elem_type;  // elem_type already mapped to the host enum
};

struct Variant {
  CUfunction fn = nullptr;
  int device = 0;
  int threads = 0;
  int shared = 0;
  bool pdl = false;
  std::string codes;
  std::vector<DescMeta> descs;
};

std::mutex g_mutex;
std::vector<Variant*> g_variants;  // handles are indices; never freed (modules live for the process)

// Triton 3.6's TMA_DTYPE_DEVICE_TO_HOST.
int tma_dtype_host(int device_type) {
  if (device_type == 8) return 10;
  if (device_type == 9) return 8;
  if (device_type == 10) return 9;
  return device_type;
}

int64_t load(int device, py::bytes cubin, const std::string& name, int shared, int num_warps, bool pdl,
             const std::string& codes, const std::vector<std::vector<int64_t>>& desc_meta) {
  const Driver& d = driver();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaFree(nullptr));  // make torch's primary context current on this thread
  std::string image = cubin;  // cuModuleLoadData reads the image during the call only
  CUmodule mod;
  CUfunction fn;
  check(d.moduleLoadData(&mod, image.data()), "cuModuleLoadData");
  check(d.moduleGetFunction(&fn, mod, name.c_str()), "cuModuleGetFunction");
  int optin = 0;
  check(d.deviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
        "cuDeviceGetAttribute");
  if (shared > 49152 && optin > 49152) {  // as Triton 3.6's loadBinary
    check(d.funcSetCacheConfig(fn, CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig");
    int shared_static = 0;
    check(d.funcGetAttribute(&shared_static, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn), "cuFuncGetAttribute");
    check(d.funcSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - shared_static),
          "cuFuncSetAttribute");
  }
  auto* v = new Variant;
  v->fn = fn;
  v->device = device;
  v->threads = 32 * num_warps;
  v->shared = shared;
  v->pdl = pdl;
  v->codes = codes;
  for (const auto& m : desc_meta) {
    TORCH_CHECK(m.size() == 5, "desc meta: [block0, block1, swizzle, elem_size, elem_type]");
    v->descs.push_back({{uint32_t(m[0]), uint32_t(m[1])}, int(m[2]), int(m[3]), tma_dtype_host(int(m[4]))});
  }
  size_t n_desc = 0;
  for (char c : codes) {
    TORCH_CHECK(std::strchr("pilfD", c) != nullptr, "unknown parameter code '", c, "'");
    n_desc += c == 'D';
  }
  TORCH_CHECK(n_desc == v->descs.size(), "descriptor parameters and tensordesc_meta differ");
  std::lock_guard<std::mutex> lock(g_mutex);
  g_variants.push_back(v);
  return int64_t(g_variants.size() - 1);
}

// One parameter slot: scalars by value, pointers by value, CUtensorMaps by value (64-byte aligned).
struct alignas(64) Slot {
  unsigned char bytes[sizeof(CUtensorMap)];
};

// Encoded descriptors by every input of cuTensorMapEncodeTiled (the rest are constants below): the encoding
// is a function of them, so a hit copies the very bytes a new encoding would give. Direct-mapped: a
// colliding input overwrites the slot. Weights keep their address from call to call, so their descriptors
// (and those of activations that land at the same address with the same shape) are encoded once.
struct DescKey {
  uint64_t ptr;
  cuuint64_t shape[2], strides[2];
  cuuint32_t box[2];
  int elem_type, swizzle;
  bool operator==(const DescKey& o) const { return std::memcmp(this, &o, sizeof(DescKey)) == 0; }
};
struct DescSlot {
  DescKey key;
  CUtensorMap map;
  bool valid = false;
};
constexpr size_t kDescSlots = 1024;
std::mutex g_desc_mutex;
DescSlot g_desc_slots[kDescSlots];

// A 2-D descriptor over `rows` x `cols` elements from `ptr`, rows `stride` elements apart (unit inner stride).
void encode(const DescMeta& m, uint64_t ptr, int64_t rows, int64_t cols, int64_t stride, CUtensorMap* out) {
  TORCH_CHECK(rows >= 0 && cols >= 0 && stride >= 0, "TMA descriptor: bad shape or stride");
  // as fill_tma_descriptor: dims and byte strides innermost first
  DescKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in the comparison
  key.ptr = ptr;
  key.shape[0] = cuuint64_t(cols);
  key.shape[1] = cuuint64_t(rows);
  key.strides[0] = cuuint64_t(stride) * m.elem_size;
  key.strides[1] = key.shape[1] * cuuint64_t(stride) * m.elem_size;
  key.box[0] = m.block[1];
  key.box[1] = m.block[0];
  key.elem_type = m.elem_type;
  key.swizzle = m.swizzle;
  uint64_t h = key.ptr >> 4;
  for (uint64_t x : {uint64_t(key.shape[0]), uint64_t(key.shape[1]), uint64_t(key.strides[0]), uint64_t(key.box[0]),
                     uint64_t(key.box[1]), uint64_t(key.elem_type), uint64_t(key.swizzle)}) {
    h = (h ^ x) * 0x9E3779B97F4A7C15ull;
  }
  DescSlot& slot = g_desc_slots[(h >> 32) % kDescSlots];
  {
    std::lock_guard<std::mutex> lock(g_desc_mutex);
    if (slot.valid && slot.key == key) {
      std::memcpy(out, &slot.map, sizeof(CUtensorMap));
      return;
    }
  }
  cuuint32_t elem_strides[2] = {1, 1};
  check(driver().tensorMapEncodeTiled(out, CUtensorMapDataType(m.elem_type), 2, reinterpret_cast<void*>(ptr), key.shape,
                                      key.strides, key.box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                      CUtensorMapSwizzle(m.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
  std::lock_guard<std::mutex> lock(g_desc_mutex);
  std::memcpy(&slot.key, &key, sizeof(DescKey));
  std::memcpy(&slot.map, out, sizeof(CUtensorMap));
  slot.valid = true;
}

const Variant& variant(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(handle >= 0 && size_t(handle) < g_variants.size(), "bad variant handle ", handle);
  return *g_variants[handle];
}

// The parameter block of one launch, filled argument by argument in the Triton signature's order.
struct Params {
  const Variant& v;
  std::vector<Slot> slots;
  std::vector<void*> params;
  size_t s = 0, di = 0;

  explicit Params(const Variant& variant) : v(variant), slots(variant.codes.size() + 4 * variant.descs.size() + 2) {
    params.reserve(slots.size());
  }
  void put(const void* src, size_t bytes) {
    std::memcpy(slots[s].bytes, src, bytes);
    params.push_back(slots[s].bytes);
    ++s;
  }
  void pointer(uint64_t p) { put(&p, sizeof(p)); }
  void integer(size_t i, char c, int64_t x) {
    if (c == 'i') {
      TORCH_CHECK(x >= INT32_MIN && x <= INT32_MAX, "argument ", i, " = ", x, " does not fit int32");
      int32_t y = int32_t(x);
      put(&y, sizeof(y));
    } else {
      TORCH_CHECK(c == 'l', "argument ", i, " (code '", c, "') is not an integer");
      put(&x, sizeof(x));
    }
  }
  void fp32(size_t i, char c, double x) {
    TORCH_CHECK(c == 'f', "argument ", i, " (code '", c, "') is not a float");
    float f = float(x);
    put(&f, sizeof(f));
  }
  void descriptor(uint64_t ptr, int64_t rows, int64_t cols, int64_t stride) {
    TORCH_CHECK(di < v.descs.size(), "more descriptor arguments than the variant has");
    encode(v.descs[di++], ptr, rows, cols, stride, reinterpret_cast<CUtensorMap*>(slots[s].bytes));
    params.push_back(slots[s].bytes);
    ++s;
    int32_t shape[2] = {int32_t(rows), int32_t(cols)};
    int64_t strides[2] = {stride, 1};
    put(&shape[0], 4);
    put(&shape[1], 4);
    put(&strides[0], 8);
    put(&strides[1], 8);
  }

  void go(int64_t gx, int64_t gy, int64_t gz) {
    TORCH_CHECK(s + 2 == slots.size(), "the variant takes ", v.codes.size(), " arguments");
    TORCH_CHECK(gx > 0 && gy > 0 && gz > 0 && gx < (1ll << 31) && gy < 65536 && gz < 65536, "bad grid");
    uint64_t null = 0;
    put(&null, sizeof(null));  // global_scratch
    put(&null, sizeof(null));  // profile_scratch
    CUlaunchAttribute attrs[1];
    CUlaunchConfig config;
    std::memset(&config, 0, sizeof(config));
    config.gridDimX = unsigned(gx);
    config.gridDimY = unsigned(gy);
    config.gridDimZ = unsigned(gz);
    config.blockDimX = unsigned(v.threads);
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = unsigned(v.shared);
    config.hStream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(v.device)).stream();
    config.attrs = attrs;
    config.numAttrs = 0;
    if (v.pdl) {
      attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[0].value.programmaticStreamSerializationAllowed = 1;
      config.numAttrs = 1;
    }
    check(driver().launchKernelEx(&config, v.fn, params.data(), nullptr), "cuLaunchKernelEx");
  }
};

const at::Tensor& as_tensor(py::handle a, size_t i, int device) {
  TORCH_CHECK(THPVariable_Check(a.ptr()), "argument ", i, " must be a tensor");
  const at::Tensor& t = THPVariable_Unpack(a.ptr());
  TORCH_CHECK(t.is_cuda() && t.get_device() == device, "argument ", i, " is not on cuda:", device);
  return t;
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// launch(handle, gx, gy, gz, *args): args in the variant's order — a tensor or None ('p'), (tensor, rows, cols,
// row stride) ('D'), an int ('i', 'l'), a float ('f').
void launch(int64_t handle, int64_t gx, int64_t gy, int64_t gz, py::args args) {
  const Variant& v = variant(handle);
  TORCH_CHECK(size_t(args.size()) == v.codes.size(), "variant takes ", v.codes.size(), " arguments, got ",
              args.size());
  Params p(v);
  for (size_t i = 0; i < v.codes.size(); ++i) {
    py::handle a = args[i];
    const char c = v.codes[i];
    if (c == 'p') {
      p.pointer(a.is_none() ? 0 : address(as_tensor(a, i, v.device)));
    } else if (c == 'D') {
      py::tuple d = py::reinterpret_borrow<py::tuple>(a);
      TORCH_CHECK(d.size() == 4, "descriptor argument ", i, ": (tensor, rows, cols, row stride)");
      p.descriptor(address(as_tensor(d[0], i, v.device)), d[1].cast<int64_t>(), d[2].cast<int64_t>(),
                   d[3].cast<int64_t>());
    } else if (c == 'f') {
      p.fp32(i, c, a.cast<double>());
    } else {
      p.integer(i, c, a.cast<int64_t>());
    }
  }
  p.go(gx, gy, gz);
}

// -- programs ---------------------------------------------------------------------------------------------------
// A program record (rlk_core.ops._cuda.Decide.program) is int64 words:
//   [device, n_buffers, per buffer (scalar type, fill, ndim, sizes...), n_launches,
//    per launch (handle, gx, gy, gz, n_args, per argument (kind, a, b, c, d, e, f)), n_outs, buffer per out, ret]
// fill 0: none, 1: -inf, 2: zeros (as torch.full / torch.zeros on the current stream); ret: what the fast path
// returns — 0 the first output, 1 all of them, 2 None.
enum ArgKind : int64_t {
  kIn = 0,     // pointer of input a, plus b bytes
  kBuf = 1,    // pointer of buffer a, plus b bytes
  kAddr = 2,   // the address a (a tensor held for good)
  kInt = 4,    // the integer a
  kFloat = 5,  // the double whose bits are a (passed as fp32: exact for fp32 values)
  kDesc = 6,   // a descriptor: base (a kind, b index or address, c bytes), d rows, e cols, f row stride
};
constexpr int kArgWords = 7;

// Reads a packed record: int64 words.
struct Words {
  const char* buf;
  size_t n, at = 0;
  Words(const char* bytes, size_t size) : buf(bytes), n(size / 8) {}
  int64_t next() {
    TORCH_CHECK(at < n, "rlk_core._C: program record too short");
    int64_t w;
    std::memcpy(&w, buf + 8 * at++, 8);
    return w;
  }
};

// A call's positional arguments: a tuple's items.
struct Inputs {
  PyObject* const* items;
  size_t n;
  explicit Inputs(const py::args& args)
      : items(reinterpret_cast<PyTupleObject*>(args.ptr())->ob_item), n(size_t(PyTuple_GET_SIZE(args.ptr()))) {}
};

uint64_t base_of(int64_t kind, int64_t index, int64_t offset, const Inputs& in, const std::vector<at::Tensor>& bufs,
                 int device, size_t i) {
  if (kind == kAddr) return uint64_t(index);
  TORCH_CHECK(index >= 0 && offset >= 0, "rlk_core._C: argument ", i, ": bad index or offset");
  if (kind == kIn) {
    TORCH_CHECK(size_t(index) < in.n, "rlk_core._C: argument ", i, " names input ", index);
    return address(as_tensor(py::handle(in.items[index]), i, device)) + uint64_t(offset);
  }
  TORCH_CHECK(kind == kBuf && size_t(index) < bufs.size(), "rlk_core._C: argument ", i, " names buffer ", index);
  return address(bufs[size_t(index)]) + uint64_t(offset);
}

// The program on `in`; None where a buffer is not 16-byte aligned (nothing launched: the caller runs the plan).
py::object run_program_record(Words w, const Inputs& in) {
  const int device = int(w.next());
  const at::TensorOptions options = at::TensorOptions().device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  std::vector<at::Tensor> bufs;
  for (int64_t b = w.next(); b > 0; --b) {
    const int64_t type = w.next(), fill = w.next();
    c10::SmallVector<int64_t, 4> shape;
    for (int64_t k = w.next(); k > 0; --k) shape.push_back(w.next());
    TORCH_CHECK(type == 3 || type == 4 || type == 5 || type == 6 || type == 15, "rlk_core._C: buffer type ", type);
    const at::TensorOptions o = options.dtype(static_cast<c10::ScalarType>(type));
    if (fill == 1) {
      bufs.push_back(at::full(shape, -std::numeric_limits<double>::infinity(), o));
    } else if (fill == 2) {
      bufs.push_back(at::zeros(shape, o));
    } else {
      TORCH_CHECK(fill == 0, "rlk_core._C: buffer fill ", fill);
      bufs.push_back(at::Tensor(at::detail::empty_cuda(shape, o)));  // torch.empty's allocation, no dispatcher
    }
    if (reinterpret_cast<uintptr_t>(bufs.back().data_ptr()) % 16 != 0) return py::none();
  }
  for (int64_t l = w.next(); l > 0; --l) {
    const Variant& v = variant(w.next());
    const int64_t gx = w.next(), gy = w.next(), gz = w.next(), n = w.next();
    TORCH_CHECK(size_t(n) == v.codes.size(), "variant takes ", v.codes.size(), " arguments, the record has ", n);
    Params p(v);
    for (size_t i = 0; i < size_t(n); ++i) {
      int64_t a[kArgWords];
      for (int64_t& x : a) x = w.next();
      const char c = v.codes[i];
      switch (a[0]) {
        case kIn:
        case kBuf:
        case kAddr:
          TORCH_CHECK(c == 'p', "argument ", i, " (code '", c, "') is not a pointer");
          p.pointer(base_of(a[0], a[1], a[2], in, bufs, v.device, i));
          break;
        case kInt:
          p.integer(i, c, a[1]);
          break;
        case kFloat: {
          double x;
          std::memcpy(&x, &a[1], 8);
          p.fp32(i, c, x);
          break;
        }
        case kDesc:
          TORCH_CHECK(c == 'D', "argument ", i, " (code '", c, "') is not a descriptor");
          p.descriptor(base_of(a[1], a[2], a[3], in, bufs, v.device, i), a[4], a[5], a[6]);
          break;
        default:
          TORCH_CHECK(false, "rlk_core._C: unknown argument kind ", a[0]);
      }
    }
    p.go(gx, gy, gz);
  }
  const int64_t n_outs = w.next();
  py::tuple outs(n_outs);
  for (int64_t k = 0; k < n_outs; ++k) {
    const int64_t b = w.next();
    TORCH_CHECK(b >= 0 && size_t(b) < bufs.size(), "rlk_core._C: output names buffer ", b);
    outs[size_t(k)] = py::cast(bufs[size_t(b)]);
  }
  return outs;
}

py::object run_program(py::bytes record, py::args args) {
  return run_program_record(Words(PyBytes_AS_STRING(record.ptr()), size_t(PyBytes_GET_SIZE(record.ptr()))),
                            Inputs(args));
}

int64_t program_ret(const std::string& packed) {  // the record's last word
  int64_t ret;
  TORCH_CHECK(packed.size() >= 8, "rlk_core._C: program record too short");
  std::memcpy(&ret, packed.data() + packed.size() - 8, 8);
  return ret;
}

// -- the fast path: a whole op call in one C++ call ---------------------------------------------------------------
// rlk_core.ops._dispatch stores, per op (a slot) and call signature, the program rlk.cuda decided the call into
// (a call whose arguments are exactly the program's inputs). `fast(slot, *args)` then does the call itself: it builds
// the signature from the arguments (per tensor: dims, sizes, strides, dtype, device, address low bits and the
// dispatch key set, which must be one stored from a plain call; None, bools, ints and floats by value; anything
// else is a miss), finds the program, counts the call in the active readback scope (the `_OpRecord` the Python call
// counted into, stored per scope, op and execution mode: a scope not stored is a miss) and runs the program.
// It returns `MISS` (the caller takes the Python path, which stores the call) where anything differs: a tensor that
// requires grad in grad mode, a tensor subclass or a type not registered as plain, a key set not seen, a torch
// function mode, a dispatch mode or a TLS-included dispatch key, RLK_VALUE_CHECKS=always, a misaligned buffer.
// Python calls `fast_clear` whenever what a selection or a decision depends on changes.

struct FastEntry {
  std::string packed;  // the program record
  int64_t ret = 0;
};
constexpr size_t kMaxEntries = 16384;  // per slot, as rlk_core.ops._cuda.MAX_DECISIONS

struct ScopeKey {
  PyObject* scope;
  int64_t slot;
  bool graph;
  bool operator==(const ScopeKey& o) const { return scope == o.scope && slot == o.slot && graph == o.graph; }
};
struct ScopeKeyHash {
  size_t operator()(const ScopeKey& k) const {
    return std::hash<void*>()(k.scope) ^ (size_t(k.slot) * 0x9E3779B97F4A7C15ull) ^ size_t(k.graph);
  }
};

struct Fast {
  std::vector<std::unordered_map<std::string, FastEntry>> slots;
  std::unordered_map<ScopeKey, std::pair<py::object, py::object>, ScopeKeyHash> scopes;  // -> (scope, record)
  std::vector<PyTypeObject*> plain_types;
  std::vector<uint64_t> key_sets;  // raw dispatch key sets of stored tensors
  PyObject* scope_var = nullptr;   // rlk_core.readback._ACTIVE
  PyObject* miss = nullptr;
  PyObject* call_count = nullptr;  // the attribute name
};

Fast& fast_state() {
  static Fast* f = new Fast;  // never destroyed: holds Python objects past interpreter teardown otherwise
  return *f;
}

template <typename T>
void put_bytes(std::string& key, const T& x) {
  key.append(reinterpret_cast<const char*>(&x), sizeof(T));
}

// The call signature of `args` into `key` (false: not a call the fast path takes).
bool signature(const Inputs& args, std::string& key, bool store) {
  Fast& f = fast_state();
  key.clear();
  bool any_tensor = false;
  const bool grad = at::GradMode::is_enabled();
  for (size_t i = 0; i < args.n; ++i) {
    PyObject* a = args.items[i];
    if (a == Py_None) {
      key.push_back('N');
    } else if (PyBool_Check(a)) {
      key.push_back(a == Py_True ? 'T' : 'F');
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow) return false;
      key.push_back('i');
      put_bytes(key, v);
    } else if (PyFloat_CheckExact(a)) {
      key.push_back('f');
      put_bytes(key, PyFloat_AS_DOUBLE(a));
    } else {
      if (!THPVariable_Check(a)) return false;
      PyTypeObject* type = Py_TYPE(a);
      if (std::find(f.plain_types.begin(), f.plain_types.end(), type) == f.plain_types.end()) return false;
      const at::Tensor& t = THPVariable_Unpack(a);
      if (!t.defined() || !t.is_cuda() || (grad && t.requires_grad())) return false;
      const uint64_t ks = t.key_set().raw_repr();
      if (std::find(f.key_sets.begin(), f.key_sets.end(), ks) == f.key_sets.end()) {
        if (!store) return false;
        f.key_sets.push_back(ks);
      }
      any_tensor = true;
      key.push_back('t');
      put_bytes(key, ks);
      put_bytes(key, int64_t(t.scalar_type()));
      put_bytes(key, int64_t(t.get_device()));
      put_bytes(key, int64_t(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
      put_bytes(key, int64_t(t.dim()));
      for (int64_t d = 0; d < t.dim(); ++d) {
        put_bytes(key, t.size(d));
        put_bytes(key, t.stride(d));
      }
    }
  }
  return any_tensor;
}

bool context_is_plain() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  if (at::impl::torch_function_mode_enabled()) return false;
  // TLS-included keys past the default ones (BackendSelect, ADInplaceOrView): functionalization, Python dispatcher
  if (!(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty()) return false;
  const char* checks = std::getenv("RLK_VALUE_CHECKS");
  return checks == nullptr || std::strcmp(checks, "always") != 0;
}

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

py::object miss() { return py::reinterpret_borrow<py::object>(fast_state().miss); }

py::object fast(int64_t slot, py::args args) {
  Fast& f = fast_state();
  if (slot < 0 || size_t(slot) >= f.slots.size() || f.slots[size_t(slot)].empty() || !context_is_plain()) {
    return miss();
  }
  const Inputs in(args);
  thread_local std::string key;
  if (!signature(in, key, false)) return miss();
  auto& entries = f.slots[size_t(slot)];
  auto it = entries.find(key);
  if (it == entries.end()) return miss();
  const FastEntry& e = it->second;
  PyObject* scope = nullptr;
  if (PyContextVar_Get(f.scope_var, nullptr, &scope) < 0) throw py::error_already_set();
  py::object scope_ref = py::reinterpret_steal<py::object>(scope);
  PyObject* record = nullptr;
  if (scope != Py_None) {
    auto s = f.scopes.find({scope, slot, capturing()});
    if (s == f.scopes.end()) return miss();
    record = s->second.second.ptr();
  }
  py::object out = run_program_record(Words(e.packed.data(), e.packed.size()), in);
  if (out.is_none()) return miss();  // a misaligned buffer: nothing launched
  if (record != nullptr) {  // the call counted as readback.note_op_call counts a repeat
    PyObject* count = PyObject_GetAttr(record, f.call_count);
    if (count == nullptr) throw py::error_already_set();
    py::object next = py::reinterpret_steal<py::object>(count) + py::int_(1);
    if (PyObject_SetAttr(record, f.call_count, next.ptr()) < 0) throw py::error_already_set();
  }
  if (e.ret == 0) return py::object(out[py::int_(0)]);
  if (e.ret == 2) return py::none();
  return out;
}

bool fast_store(int64_t slot, py::bytes packed, py::args args) {
  Fast& f = fast_state();
  TORCH_CHECK(slot >= 0 && slot < 4096, "rlk_core._C.fast_store: slot ", slot);
  std::string key;
  if (!signature(Inputs(args), key, true)) return false;
  if (f.slots.size() <= size_t(slot)) f.slots.resize(size_t(slot) + 1);
  auto& entries = f.slots[size_t(slot)];
  if (entries.size() >= kMaxEntries) entries.clear();
  FastEntry e;
  e.packed = packed;
  e.ret = program_ret(e.packed);
  TORCH_CHECK(e.ret >= 0 && e.ret <= 2, "rlk_core._C.fast_store: return kind ", e.ret);
  entries[key] = std::move(e);
  return true;
}

void fast_count_into(py::object scope, int64_t slot, bool graph, py::object record) {
  Fast& f = fast_state();
  if (f.scopes.size() >= 4096) f.scopes.clear();
  f.scopes[{scope.ptr(), slot, graph}] = {scope, record};
}

void fast_clear() {
  Fast& f = fast_state();
  f.slots.clear();
  f.scopes.clear();
}

void fast_setup(py::object scope_var, py::object miss_object, const std::vector<py::object>& plain_types) {
  Fast& f = fast_state();
  TORCH_CHECK(PyContextVar_CheckExact(scope_var.ptr()), "rlk_core._C.fast_setup: a contextvars.ContextVar");
  Py_XDECREF(f.scope_var);
  Py_XDECREF(f.miss);
  f.scope_var = scope_var.inc_ref().ptr();
  f.miss = miss_object.inc_ref().ptr();
  if (f.call_count == nullptr) f.call_count = PyUnicode_InternFromString("call_count");
  f.plain_types.clear();
  for (const auto& t : plain_types) {
    TORCH_CHECK(PyType_Check(t.ptr()), "rlk_core._C.fast_setup: plain types must be types");
    f.plain_types.push_back(reinterpret_cast<PyTypeObject*>(t.inc_ref().ptr()));
  }
  fast_clear();
}

size_t fast_size() {
  size_t n = 0;
  for (const auto& s : fast_state().slots) n += s.size();
  return n;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rlk_core._C: the launcher of rlk_core.aot's cubins (backend rlk.cuda)";
  m.attr("CUDA_VERSION") = CUDA_VERSION;
  m.def("load", &load, "load one cubin variant on a device; returns its handle",
        py::arg("device"), py::arg("cubin"), py::arg("name"), py::arg("shared"), py::arg("num_warps"),
        py::arg("pdl"), py::arg("codes"), py::arg("desc_meta"));
  m.def("launch", &launch, "one launch on the current stream: launch(handle, gx, gy, gz, *args)");
  m.def("run_program", &run_program, "a decided call's launches over the buffers it allocates: run_program(record, "
        "*inputs) -> the output buffers, or None (a buffer not 16-byte aligned: nothing launched)");
  m.def("fast", &fast, "a whole op call, stored before: fast(slot, *args) -> the op's result, or the MISS object");
  m.def("fast_store", &fast_store, "store one call signature of an op with its program: fast_store(slot, record, "
        "*args)");
  m.def("fast_count_into", &fast_count_into, "the _OpRecord a readback scope counts an op's calls into");
  m.def("fast_clear", &fast_clear, "forget every stored call");
  m.def("fast_setup", &fast_setup, "the readback scope variable, the MISS object and the plain tensor types");
  m.def("fast_size", &fast_size, "how many call signatures fast() knows");
}
