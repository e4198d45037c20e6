// rlk_core._C: launches the ahead-of-time built Triton cubins of rlk_core.aot (backend rlk.cuda).
//
// The driver API is reached through dlopen("libcuda.so.1") + dlsym, as Triton's own launcher does, so the
// extension links against nothing but torch and builds on a machine without a GPU driver. Per variant
// (one cubin of the manifest) `load` is called once per device: cuModuleLoadData, cuModuleGetFunction,
// dynamic shared memory above 48 KiB opted in exactly as Triton 3.6's loadBinary does, and the parameter
// list kept as a type code string. `launch` then takes the kernel's non-constexpr arguments in the
// Triton signature's order and builds the cubin's parameter block:
//   'p' pointer (a tensor's data_ptr, None -> 0), 'i' int32, 'l' int64, 'f' fp32,
//   'D' a TMA descriptor argument: a 2-D tensor from which the CUtensorMap is encoded (as Triton 3.6's
//       fill_tma_descriptor does, from the manifest's tensordesc_meta) and followed by its shape (i32 x2)
//       and strides (i64 x2, in elements),
// then the two scratch pointers Triton 3.6 appends (null: variants with scratch are refused at load).
// The launch goes to torch's current stream of the tensors' device with cuLaunchKernelEx, adding the
// programmatic-stream-serialization attribute for launch_pdl variants.
// TMA descriptors are kept by their encoding's inputs (a hit copies the same bytes; see DescKey).
// `run` is `launch` with the arguments described once per call signature by a record (the bytes of
// rlk_core.ops._cuda_common.Launch.pack): it allocates the output (or none, for a kernel that writes into its
// inputs), takes the inputs, views of them, scalars and constants the record names, launches the same way and
// returns the output — one call per op call on the hot path. `run_program` (rlk_core.ops._cuda_common.Program)
// does the same for an op made of several launches: it allocates (and fills) the buffers the record names,
// launches each kernel in order on pointers into inputs and buffers, and returns the output buffers.

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
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <cstdlib>
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

void encode(const Variant& v, const DescMeta& m, const at::Tensor& t, CUtensorMap* out) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "TMA descriptor operand must be 2-D with unit inner stride");
  // as fill_tma_descriptor: dims and byte strides innermost first
  DescKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in the comparison
  key.ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  key.shape[0] = cuuint64_t(t.size(1));
  key.shape[1] = cuuint64_t(t.size(0));
  key.strides[0] = cuuint64_t(t.stride(0)) * m.elem_size;
  key.strides[1] = key.shape[1] * cuuint64_t(t.stride(0)) * m.elem_size;
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
  check(driver().tensorMapEncodeTiled(out, CUtensorMapDataType(m.elem_type), 2, t.data_ptr(), key.shape,
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
  void pointer(size_t i, const at::Tensor* t) {  // nullptr: None
    uint64_t p = 0;
    if (t != nullptr) {
      TORCH_CHECK(t->is_cuda() && t->get_device() == v.device, "argument ", i, " is not on cuda:", v.device);
      p = reinterpret_cast<uint64_t>(t->data_ptr());
    }
    put(&p, sizeof(p));
  }
  void pointer_at(size_t i, const at::Tensor& t, int64_t byte_offset) {  // a slice's first element
    TORCH_CHECK(t.is_cuda() && t.get_device() == v.device, "argument ", i, " is not on cuda:", v.device);
    TORCH_CHECK(byte_offset >= 0 && byte_offset < std::max<int64_t>(t.numel(), 1) * int64_t(t.element_size()),
                "argument ", i, ": offset ", byte_offset, " bytes past the tensor");
    uint64_t p = reinterpret_cast<uint64_t>(t.data_ptr()) + uint64_t(byte_offset);
    put(&p, sizeof(p));
  }
  void int32(size_t i, int64_t x) {
    TORCH_CHECK(x >= INT32_MIN && x <= INT32_MAX, "argument ", i, " = ", x, " does not fit int32");
    int32_t y = int32_t(x);
    put(&y, sizeof(y));
  }
  void int64(int64_t x) { put(&x, sizeof(x)); }
  void fp32(double x) {
    float f = float(x);
    put(&f, sizeof(f));
  }
  void descriptor(size_t i, const at::Tensor& t) {
    TORCH_CHECK(t.is_cuda() && t.get_device() == v.device, "descriptor ", i, " is not on cuda:", v.device);
    encode(v, v.descs[di++], t, reinterpret_cast<CUtensorMap*>(slots[s].bytes));
    params.push_back(slots[s].bytes);
    ++s;
    int32_t shape[2] = {int32_t(t.size(0)), int32_t(t.size(1))};
    int64_t strides[2] = {t.stride(0), t.stride(1)};
    put(&shape[0], 4);
    put(&shape[1], 4);
    put(&strides[0], 8);
    put(&strides[1], 8);
  }
  // one argument by its parameter code: a tensor (nullptr: None) for 'p' and 'D', a scalar otherwise
  void arg(size_t i, char c, const at::Tensor* t, py::handle a, const int64_t* constant) {
    switch (c) {
      case 'p':
        TORCH_CHECK(constant == nullptr, "argument ", i, " is a pointer, the record gives an integer");
        pointer(i, t);
        break;
      case 'D':
        TORCH_CHECK(t != nullptr, "descriptor argument ", i, " must be a tensor");
        descriptor(i, *t);
        break;
      case 'i':
        int32(i, constant != nullptr ? *constant : a.cast<int64_t>());
        break;
      case 'l':
        int64(constant != nullptr ? *constant : a.cast<int64_t>());
        break;
      case 'f':
        fp32(constant != nullptr ? double(*constant) : a.cast<double>());
        break;
      default:
        TORCH_CHECK(false, "unknown parameter code '", c, "'");
    }
  }

  void go(int64_t gx, int64_t gy, int64_t gz) {
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

const at::Tensor& tensor_arg(py::handle a, size_t i, char c = 'p') {
  if (c == 'D') {
    TORCH_CHECK(THPVariable_Check(a.ptr()), "descriptor argument ", i, " must be a tensor");
  } else {
    TORCH_CHECK(THPVariable_Check(a.ptr()), "argument ", i, " must be a tensor or None");
  }
  return THPVariable_Unpack(a.ptr());
}

void launch(int64_t handle, int64_t gx, int64_t gy, int64_t gz, py::args args) {
  const Variant& v = variant(handle);
  const size_t n = v.codes.size();
  TORCH_CHECK(size_t(args.size()) == n, "variant takes ", n, " arguments, got ", args.size());
  TORCH_CHECK(gx > 0 && gy > 0 && gz > 0 && gx < (1ll << 31) && gy < 65536 && gz < 65536, "bad grid");
  Params p(v);
  for (size_t i = 0; i < n; ++i) {
    py::handle a = args[i];
    const char c = v.codes[i];
    const bool tensor = c == 'p' || c == 'D';
    p.arg(i, c, tensor && !(a.is_none() && c == 'p') ? &tensor_arg(a, i, c) : nullptr, a, nullptr);
  }
  p.go(gx, gy, gz);
}

// Kinds of a record's argument (rlk_core.ops._cuda_common: T, V, O, S, C, F, R, B, TA, BA).
enum Kind : int64_t {
  kInput = 0,      // input `value`: a tensor (or None for a pointer) or a scalar
  kInput2d = 1,    // input `value` viewed [-1, last] (a TMA descriptor operand with leading dims)
  kOutput = 2,     // run: the output it allocates (buffer 0)
  kScalar = 3,     // input `value`, a Python scalar
  kConst = 4,      // the integer `value`
  kConstF = 5,     // the double whose bits are `value` (passed as fp32: exact for fp32-representable values)
  kInputRows = 6,  // input `value` viewed [size(0), -1] (a TMA descriptor over rows of several heads)
  kBuffer = 7,     // run_program: buffer `value`
  kInputAt = 8,    // pointer of input (value & 255) plus (value >> 8) bytes (a column or row slice)
  kBufferAt = 9,   // pointer of buffer (value & 255) plus (value >> 8) bytes
};

// Reads a packed record: int64 words.
struct Words {
  const char* buf;
  size_t n, at = 0;
  Words(const char* bytes, size_t size) : buf(bytes), n(size / 8) {}
  explicit Words(const py::bytes& record)
      : Words(PyBytes_AS_STRING(record.ptr()), size_t(PyBytes_GET_SIZE(record.ptr()))) {}
  int64_t next() {
    TORCH_CHECK(at < n, "rlk_core._C: launch record too short");
    int64_t w;
    std::memcpy(&w, buf + 8 * at++, 8);
    return w;
  }
};

// The inputs of a record: a call's positional arguments (a tuple's items, or the fast path's own list).
struct Inputs {
  PyObject* const* items;
  size_t n;
  size_t size() const { return n; }
  py::handle operator[](size_t i) const { return py::handle(items[i]); }
};

Inputs inputs_of(const py::args& args) {
  return {reinterpret_cast<PyTupleObject*>(args.ptr())->ob_item, size_t(PyTuple_GET_SIZE(args.ptr()))};
}

const at::Tensor& input_tensor(const Inputs& args, int64_t index, size_t i, char c) {
  TORCH_CHECK(index >= 0 && size_t(index) < args.size(), "rlk_core._C: argument ", i, " names input ", index);
  return tensor_arg(args[size_t(index)], i, c);
}

const at::Tensor& buffer(const std::vector<at::Tensor>& bufs, int64_t index, size_t i) {
  TORCH_CHECK(index >= 0 && size_t(index) < bufs.size(), "rlk_core._C: argument ", i, " names buffer ", index);
  return bufs[size_t(index)];
}

// One kernel argument of a record: `i` its position, `c` its parameter code, (kind, value) from the record,
// `bufs` the tensors the record allocated (run: the output, buffer 0).
void record_arg(Params& p, size_t i, char c, int64_t kind, int64_t value, const Inputs& args,
                const std::vector<at::Tensor>& bufs) {
  const bool tensor = c == 'p' || c == 'D';
  switch (kind) {
    case kConst:
      p.arg(i, c, nullptr, py::none(), &value);
      return;
    case kConstF: {
      TORCH_CHECK(c == 'f', "argument ", i, " (code '", c, "') cannot take a float constant");
      double x;
      std::memcpy(&x, &value, 8);
      p.fp32(x);
      return;
    }
    case kOutput:
    case kBuffer:
      TORCH_CHECK(tensor, "argument ", i, " (code '", c, "') cannot take a buffer");
      p.arg(i, c, &buffer(bufs, kind == kOutput ? 0 : value, i), py::none(), nullptr);
      return;
    case kScalar: {
      TORCH_CHECK(!tensor, "argument ", i, " (code '", c, "') cannot take a scalar");
      TORCH_CHECK(value >= 0 && size_t(value) < args.size(), "rlk_core._C: argument ", i, " names input ", value);
      p.arg(i, c, nullptr, args[size_t(value)], nullptr);
      return;
    }
    case kInput2d:
    case kInputRows: {
      const at::Tensor& t = input_tensor(args, value, i, c);
      const at::Tensor t2 = kind == kInput2d ? t.view({-1, t.size(-1)}) : t.view({t.size(0), -1});
      p.arg(i, c, &t2, py::none(), nullptr);
      return;
    }
    case kInputAt:
    case kBufferAt: {
      TORCH_CHECK(c == 'p', "argument ", i, " (code '", c, "') is not a pointer");
      const at::Tensor& t = kind == kInputAt ? input_tensor(args, value & 255, i, c) : buffer(bufs, value & 255, i);
      p.pointer_at(i, t, value >> 8);
      return;
    }
    case kInput: {
      TORCH_CHECK(value >= 0 && size_t(value) < args.size(), "rlk_core._C: argument ", i, " names input ", value);
      py::handle a = args[size_t(value)];
      p.arg(i, c, tensor && !(a.is_none() && c == 'p') ? &tensor_arg(a, i, c) : nullptr, a, nullptr);
      return;
    }
    default:
      TORCH_CHECK(false, "rlk_core._C: unknown argument kind ", kind);
  }
}

// One launch of a record: its variant's arguments, (kind, value) each, then the launch.
void record_launch(Words& w, const Variant& v, int64_t gx, int64_t gy, int64_t gz, const Inputs& args,
                   const std::vector<at::Tensor>& bufs) {
  const int64_t n = w.next();
  TORCH_CHECK(size_t(n) == v.codes.size(), "variant takes ", v.codes.size(), " arguments, the record has ", n);
  Params p(v);
  for (size_t i = 0; i < size_t(n); ++i) {
    const int64_t kind = w.next(), value = w.next();
    record_arg(p, i, v.codes[i], kind, value, args, bufs);
  }
  p.go(gx, gy, gz);
}

// run(record, *inputs): record = int64s [handle, out_aligned, gx, gy, gz, like, n_alloc, alloc...,
// n_final, final..., n_args, (kind, value) per kernel argument]. Returns the output viewed as `final`, or
// None (nothing launched) where out_aligned is set and the allocation is not 16-byte aligned. n_alloc = -1:
// the kernel writes no output of its own (only its inputs, e.g. a KV cache): nothing is allocated, the launch
// always happens and None is returned.
// run's work on a record's bytes; `launched` says whether the kernel ran (false: the allocation was misaligned).
py::object run_record(Words w, const Inputs& args, bool& launched) {
  launched = false;
  const int64_t handle = w.next(), out_aligned = w.next(), gx = w.next(), gy = w.next(), gz = w.next(),
                like = w.next();
  const int64_t n_alloc = w.next();
  c10::SmallVector<int64_t, 4> alloc, final_shape;
  for (int64_t k = n_alloc; k > 0; --k) alloc.push_back(w.next());
  for (int64_t k = w.next(); k > 0; --k) final_shape.push_back(w.next());
  const Variant& v = variant(handle);
  std::vector<at::Tensor> bufs;
  if (n_alloc >= 0) {
    // the CUDA allocation itself (torch.empty's, less the dispatcher): the caching allocator, the current stream
    bufs.push_back(at::Tensor(at::detail::empty_cuda(alloc, input_tensor(args, like, 0, 'p').options())));
    if (out_aligned && reinterpret_cast<uintptr_t>(bufs[0].data_ptr()) % 16 != 0) return py::none();
  } else {
    TORCH_CHECK(!out_aligned && final_shape.empty(), "rlk_core._C.run: a record without output returns none");
  }
  record_launch(w, v, gx, gy, gz, args, bufs);
  launched = true;
  if (n_alloc < 0) return py::none();
  return py::cast(bufs[0].sizes().equals(final_shape) ? bufs[0] : bufs[0].view(final_shape));
}

py::object run(py::bytes record, py::args args) {
  bool launched;
  return run_record(Words(record), inputs_of(args), launched);
}

// run_program(record, *inputs): several launches over buffers it allocates, for an op made of a few kernels.
// record = int64s [like, n_bufs, per buffer (scalar type, fill, ndim, sizes...), n_launches, per launch
// (handle, gx, gy, gz, n_args, (kind, value) per argument), n_outs, buffer index per output]; fill 0: none,
// 1: -inf, 2: zeros (as torch.full / torch.zeros would: on the current stream). Buffers are allocated like
// input `like` (its device); returns the output buffers as a tuple, or None (nothing launched) where a buffer
// is not 16-byte aligned (the variants assume it: the caller's general code then runs the call).
py::object run_program_record(Words w, const Inputs& args) {
  const at::TensorOptions options = input_tensor(args, w.next(), 0, 'p').options();
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
      bufs.push_back(at::empty(shape, o));
    }
    if (reinterpret_cast<uintptr_t>(bufs.back().data_ptr()) % 16 != 0) return py::none();
  }
  for (int64_t l = w.next(); l > 0; --l) {
    const int64_t handle = w.next(), gx = w.next(), gy = w.next(), gz = w.next();
    record_launch(w, variant(handle), gx, gy, gz, args, bufs);
  }
  const int64_t n_outs = w.next();
  py::tuple outs(n_outs);
  for (int64_t k = 0; k < n_outs; ++k) outs[size_t(k)] = py::cast(buffer(bufs, w.next(), 0));
  return outs;
}

py::object run_program(py::bytes record, py::args args) { return run_program_record(Words(record), inputs_of(args)); }


// -- the fast path: a whole op call in one C++ call ------------------------------------------------------------
// rlk_core.ops._dispatch teaches, per op (a slot) and call signature, the record its rlk.cuda backend launched for
// that signature in a Python call (what the op would do again: select rlk.cuda, note the call, one _C.run or
// _C.run_program of that record on the same arguments). `fast(slot, *args)` then does the call itself: it builds
// the signature from the arguments (per tensor: dims, sizes, strides, dtype, device, address low bits and the
// dispatch key set, which must be one taught from a plain call; None, bools, ints and floats by value; anything
// else is a miss), finds the entry, counts the call in the active readback scope (the `_OpRecord` the Python
// call counted into, taught per scope, op and execution mode: a scope not taught is a miss) and runs the record.
// It returns `MISS` (the caller runs the Python path, which teaches) where anything differs from the taught call:
// a tensor that requires grad in grad mode, a tensor subclass or a type not registered as plain, a key set not
// seen, a torch function mode, a dispatch mode or a TLS-included dispatch key, RLK_VALUE_CHECKS=always, a
// misaligned allocation. Python calls `fast_reset` whenever what a selection or a decision depends on changes.

struct FastEntry {
  bool program = false;                 // run_program (else run)
  std::string packed;                   // the record's bytes
  std::vector<int64_t> map;             // per record input: argument i (>= 0), i + kTransposed (its .t()), -1-j
  std::vector<py::object> extras;       // extra j: a tensor the op keeps alive for good, or a constant
  int rebuild = 0;                      // 0: the record's result as it is, 1: its first element
};
constexpr int64_t kTransposed = 10000;
constexpr size_t kMaxEntries = 16384;    // per slot, as rlk_core.ops._cuda_common.MAX_RECORDS

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
  std::vector<uint64_t> key_sets;  // raw dispatch key sets of taught tensors
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

// The call signature of `args` into `key` (false: not a call the fast path takes); `device` the first tensor's.
bool signature(const Inputs& args, std::string& key, int& device, bool teach) {
  Fast& f = fast_state();
  key.clear();
  device = -1;
  const bool grad = at::GradMode::is_enabled();
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* a = args[i].ptr();
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
        if (!teach) return false;
        f.key_sets.push_back(ks);
      }
      const int dev = t.get_device();
      if (device < 0) device = dev;
      key.push_back('t');
      put_bytes(key, ks);
      put_bytes(key, int64_t(t.scalar_type()));
      put_bytes(key, int64_t(dev));
      put_bytes(key, int64_t(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
      put_bytes(key, int64_t(t.dim()));
      for (int64_t d = 0; d < t.dim(); ++d) {
        put_bytes(key, t.size(d));
        put_bytes(key, t.stride(d));
      }
    }
  }
  return device >= 0;
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
  const Inputs in = inputs_of(args);
  thread_local std::string key;
  int device;
  if (!signature(in, key, device, false)) return miss();
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
  c10::SmallVector<PyObject*, 8> items(e.map.size());
  c10::SmallVector<py::object, 2> views;
  for (size_t i = 0; i < e.map.size(); ++i) {
    const int64_t m = e.map[i];
    if (m < 0) {
      items[i] = e.extras[size_t(-1 - m)].ptr();
    } else if (m >= kTransposed) {
      views.push_back(py::cast(THPVariable_Unpack(in[size_t(m - kTransposed)].ptr()).t()));
      items[i] = views.back().ptr();
    } else {
      items[i] = in[size_t(m)].ptr();
    }
  }
  const Inputs record_in{items.data(), items.size()};
  const Words words(e.packed.data(), e.packed.size());
  py::object out;
  if (e.program) {
    out = run_program_record(words, record_in);
    if (out.is_none()) return miss();  // a misaligned buffer: nothing launched
  } else {
    bool launched;
    out = run_record(words, record_in, launched);
    if (!launched) return miss();
  }
  if (record != nullptr) {  // the call counted as readback.note_op_call counts a repeat
    PyObject* count = PyObject_GetAttr(record, f.call_count);
    if (count == nullptr) throw py::error_already_set();
    py::object next = py::reinterpret_steal<py::object>(count) + py::int_(1);
    if (PyObject_SetAttr(record, f.call_count, next.ptr()) < 0) throw py::error_already_set();
  }
  return e.rebuild == 1 ? py::object(out[py::int_(0)]) : out;
}

bool fast_teach(int64_t slot, bool program, py::bytes packed, const std::vector<int64_t>& map, py::tuple extras,
                int rebuild, py::args args) {
  Fast& f = fast_state();
  TORCH_CHECK(slot >= 0 && slot < 4096, "rlk_core._C.fast_teach: slot ", slot);
  TORCH_CHECK(rebuild == 0 || rebuild == 1, "rlk_core._C.fast_teach: rebuild ", rebuild);
  const Inputs in = inputs_of(args);
  for (int64_t m : map) {
    const bool ok = m < 0 ? size_t(-1 - m) < size_t(extras.size())
                          : size_t(m >= kTransposed ? m - kTransposed : m) < in.size();
    TORCH_CHECK(ok, "rlk_core._C.fast_teach: input ", m, " names nothing");
  }
  std::string key;
  int device;
  if (!signature(in, key, device, true)) return false;
  if (f.slots.size() <= size_t(slot)) f.slots.resize(size_t(slot) + 1);
  auto& entries = f.slots[size_t(slot)];
  if (entries.size() >= kMaxEntries) entries.clear();
  FastEntry e;
  e.program = program;
  e.packed = packed;
  e.map = map;
  for (auto x : extras) e.extras.push_back(py::reinterpret_borrow<py::object>(x));
  e.rebuild = rebuild;
  entries[key] = std::move(e);
  return true;
}

void fast_scope(py::object scope, int64_t slot, bool graph, py::object record) {
  Fast& f = fast_state();
  if (f.scopes.size() >= 4096) f.scopes.clear();
  f.scopes[{scope.ptr(), slot, graph}] = {scope, record};
}

void fast_reset() {
  Fast& f = fast_state();
  f.slots.clear();
  f.scopes.clear();
}

void fast_init(py::object scope_var, py::object miss_object, const std::vector<py::object>& plain_types) {
  Fast& f = fast_state();
  TORCH_CHECK(PyContextVar_CheckExact(scope_var.ptr()), "rlk_core._C.fast_init: a contextvars.ContextVar");
  Py_XDECREF(f.scope_var);
  Py_XDECREF(f.miss);
  f.scope_var = scope_var.inc_ref().ptr();
  f.miss = miss_object.inc_ref().ptr();
  if (f.call_count == nullptr) f.call_count = PyUnicode_InternFromString("call_count");
  f.plain_types.clear();
  for (const auto& t : plain_types) {
    TORCH_CHECK(PyType_Check(t.ptr()), "rlk_core._C.fast_init: plain types must be types");
    f.plain_types.push_back(reinterpret_cast<PyTypeObject*>(t.inc_ref().ptr()));
  }
  fast_reset();
}

size_t fast_entries() {
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
  m.def("launch", &launch, "launch a loaded variant on the current stream: launch(handle, gx, gy, gz, *args)");
  m.def("run", &run, "launch a record's variant on the current stream, allocating its output: run(record, *inputs)");
  m.def("run_program", &run_program,
        "a record's launches over the buffers it allocates, on the current stream: run_program(record, *inputs)");
  m.def("fast", &fast, "a whole op call, taught before: fast(slot, *args) -> the op's result, or the MISS object");
  m.def("fast_teach", &fast_teach, "teach fast() one call signature of an op: its record, inputs and result",
        py::arg("slot"), py::arg("program"), py::arg("packed"), py::arg("map"), py::arg("extras"), py::arg("rebuild"));
  m.def("fast_scope", &fast_scope, "teach fast() the _OpRecord a readback scope counts an op's calls into");
  m.def("fast_reset", &fast_reset, "forget everything fast() was taught");
  m.def("fast_init", &fast_init, "the readback scope variable, the MISS object and the plain tensor types");
  m.def("fast_entries", &fast_entries, "how many call signatures fast() knows");
}
