// A stand-in for the CUDA runtime pieces that autograd and the dispatcher touch, so that
// tensors of torch's FakeTensorMode on device "cuda" run forward *and* backward in a
// CPU-only build of torch (tests only; nothing here computes, fake tensors have no data).
//
// Without it a CPU build aborts the process at the first autograd node on a fake CUDA
// tensor ("PyTorch is not linked with support for cuda devices": no CUDA device guard) and
// the engine then refuses to run backward ("Cannot access accelerator device when none is
// available": the CUDA hooks report no CUDA build). A CUDA build of torch on a machine without
// a GPU fails the same way, its hooks reporting no device. Load it before torch is imported.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

// One CUDA device, index 0, a default stream, events that are always complete.
struct FakeCUDAGuard final : public c10::impl::DeviceGuardImplInterface {
  static thread_local c10::DeviceIndex current;
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = current;
    current = d.index();
    return c10::Device(c10::DeviceType::CUDA, old);
  }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, current); }
  void setDevice(c10::Device d) const override { current = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};
thread_local c10::DeviceIndex FakeCUDAGuard::current = 0;
C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuard);

// What at::accelerator asks of a CUDA build (getAccelerator reads isBuilt()).
struct FakeCUDAHooks final : public at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};

}  // namespace

// A CUDA build of torch registers its own device guard when its CUDA library loads, after this
// one: the process calls this once torch is imported, so that the stand-in guards CUDA.
extern "C" void fake_cuda_take_over() {
  static FakeCUDAGuard guard;
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)].store(&guard);
}

namespace at {
// Preferred over torch's own hooks, which a CUDA build of torch registers (on a machine
// without a GPU they report no device, and autograd on fake CUDA tensors fails).
C10_REGISTER_CLASS_WITH_PRIORITY(CUDAHooksRegistry, CUDAHooks, c10::REGISTRY_PREFERRED, FakeCUDAHooks);
}
