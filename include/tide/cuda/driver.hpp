// CUDA driver API entry points, resolved at run time through the runtime
// (cudaGetDriverEntryPointByVersion), so that tide_cuda and its tests never link libcuda.so.1
// and load on machines without a driver (where every test skips).
#pragma once
#include <cuda.h>

namespace tide::cuda {

struct Driver {
#define TIDE_DRIVER_FN(name) decltype(&::name) name = nullptr;
  TIDE_DRIVER_FN(cuGetErrorString)
  TIDE_DRIVER_FN(cuInit)
  TIDE_DRIVER_FN(cuDeviceGet)
  TIDE_DRIVER_FN(cuDeviceGetAttribute)
  TIDE_DRIVER_FN(cuStreamWriteValue32)
  TIDE_DRIVER_FN(cuStreamWaitValue32)
  TIDE_DRIVER_FN(cuMemCreate)
  TIDE_DRIVER_FN(cuMemGetAllocationGranularity)
  TIDE_DRIVER_FN(cuMemRelease)
  TIDE_DRIVER_FN(cuMemMap)
  TIDE_DRIVER_FN(cuMemUnmap)
  TIDE_DRIVER_FN(cuMemSetAccess)
  TIDE_DRIVER_FN(cuMemAddressReserve)
  TIDE_DRIVER_FN(cuMemAddressFree)
  TIDE_DRIVER_FN(cuMemExportToShareableHandle)
  TIDE_DRIVER_FN(cuMemImportFromShareableHandle)
#undef TIDE_DRIVER_FN
};

// The driver's entry points; nullptr when there is no usable driver (never throws).
// Entry points a driver lacks stay null.
const Driver* try_driver();
// Same, but throws tide::Error naming the rank when there is no driver.
const Driver& driver();

}  // namespace tide::cuda
