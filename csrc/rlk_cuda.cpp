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

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
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

void encode(const Variant& v, const DescMeta& m, const at::Tensor& t, CUtensorMap* out) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "TMA descriptor operand must be 2-D with unit inner stride");
  // as fill_tma_descriptor: dims and byte strides innermost first
  cuuint64_t shape[2] = {cuuint64_t(t.size(1)), cuuint64_t(t.size(0))};
  cuuint64_t strides[2] = {cuuint64_t(t.stride(0)) * m.elem_size, shape[1] * cuuint64_t(t.stride(0)) * m.elem_size};
  cuuint32_t box[2] = {m.block[1], m.block[0]};
  cuuint32_t elem_strides[2] = {1, 1};
  check(driver().tensorMapEncodeTiled(out, CUtensorMapDataType(m.elem_type), 2, t.data_ptr(), shape, strides, box,
                                      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                      CUtensorMapSwizzle(m.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
}

void launch(int64_t handle, int64_t gx, int64_t gy, int64_t gz, py::args args) {
  const Variant* vp;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(handle >= 0 && size_t(handle) < g_variants.size(), "bad variant handle ", handle);
    vp = g_variants[handle];
  }
  const Variant& v = *vp;
  const size_t n = v.codes.size();
  TORCH_CHECK(size_t(args.size()) == n, "variant takes ", n, " arguments, got ", args.size());
  TORCH_CHECK(gx > 0 && gy > 0 && gz > 0 && gx < (1ll << 31) && gy < 65536 && gz < 65536, "bad grid");
  std::vector<Slot> slots(n + 4 * v.descs.size() + 2);
  std::vector<void*> params;
  params.reserve(slots.size());
  size_t s = 0, di = 0;
  auto put = [&](const void* src, size_t bytes) {
    std::memcpy(slots[s].bytes, src, bytes);
    params.push_back(slots[s].bytes);
    ++s;
  };
  for (size_t i = 0; i < n; ++i) {
    py::handle a = args[i];
    switch (v.codes[i]) {
      case 'p': {
        uint64_t p = 0;
        if (!a.is_none()) {
          TORCH_CHECK(THPVariable_Check(a.ptr()), "argument ", i, " must be a tensor or None");
          const at::Tensor& t = THPVariable_Unpack(a.ptr());
          TORCH_CHECK(t.is_cuda() && t.get_device() == v.device, "argument ", i, " is not on cuda:", v.device);
          p = reinterpret_cast<uint64_t>(t.data_ptr());
        }
        put(&p, sizeof(p));
        break;
      }
      case 'i': {
        int64_t x = a.cast<int64_t>();
        TORCH_CHECK(x >= INT32_MIN && x <= INT32_MAX, "argument ", i, " = ", x, " does not fit int32");
        int32_t y = int32_t(x);
        put(&y, sizeof(y));
        break;
      }
      case 'l': {
        int64_t x = a.cast<int64_t>();
        put(&x, sizeof(x));
        break;
      }
      case 'f': {
        float f = float(a.cast<double>());
        put(&f, sizeof(f));
        break;
      }
      case 'D': {
        TORCH_CHECK(THPVariable_Check(a.ptr()), "descriptor argument ", i, " must be a tensor");
        const at::Tensor& t = THPVariable_Unpack(a.ptr());
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
        break;
      }
    }
  }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rlk_core._C: the launcher of rlk_core.aot's cubins (backend rlk.cuda)";
  m.attr("CUDA_VERSION") = CUDA_VERSION;
  m.def("load", &load, "load one cubin variant on a device; returns its handle",
        py::arg("device"), py::arg("cubin"), py::arg("name"), py::arg("shared"), py::arg("num_warps"),
        py::arg("pdl"), py::arg("codes"), py::arg("desc_meta"));
  m.def("launch", &launch, "launch a loaded variant on the current stream: launch(handle, gx, gy, gz, *args)");
}
