// A stand-in for the CUDA runtime pieces that autograd and the dispatcher touch, so that
// tensors of torch's FakeTensorMode on device "cuda" run forward *and* backward in a
// CPU-only build of torch (tests only; nothing here computes, fake tensors have no data).
//
// Without it a CPU build aborts the process at the first autograd node on a fake CUDA
// tensor ("PyTorch is not linked with support for cuda devices": no CUDA device guard) and
// the engine then refuses to run backward ("Cannot access accelerator device when none is
// available": the CUDA hooks report no CUDA build). Load it before torch is imported.
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

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
