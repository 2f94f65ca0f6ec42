// Binding torch's OpenMP threads to cores (op `octavo_cpu::bind_threads`).
//   bind_threads(cpus, include_caller) -> [cpu per thread, -1 = not bound]
// Runs one OpenMP parallel region of len(cpus) threads, the team torch's parallel_for reuses
// (torch.set_num_threads(len(cpus)) first); thread t pins itself to cpus[t]. Thread 0 is the
// calling thread: it is pinned only with include_caller, since processes and threads it starts
// later inherit its mask (a library must not pin its caller's main thread).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#include <omp.h>

namespace octavo_cpu {
namespace {

std::vector<int64_t> bind_threads(std::vector<int64_t> cpus, bool include_caller) {
  const int n = int(cpus.size());
  TORCH_CHECK(n > 0, "octavo_cpu: bind_threads needs at least one CPU");
  std::vector<int64_t> bound(n, -1);
#if defined(__linux__)
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t < n && (t > 0 || include_caller)) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      CPU_SET(int(cpus[t]), &mask);
      if (sched_setaffinity(0, sizeof(mask), &mask) == 0) bound[t] = cpus[t];
    }
  }
#endif
  return bound;
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("bind_threads(int[] cpus, bool include_caller) -> int[]", &octavo_cpu::bind_threads);
}
