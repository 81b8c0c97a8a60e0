// What the kernels use, included once at the top of each ISA's unit (outside its namespace): tensors
// (allocating with new_empty), dtype dispatch, at::parallel_for, and the dispatcher (layer.cpp calls
// oneDNN's and aten's linear as Python does).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
