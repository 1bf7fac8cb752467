// The kernels' thread pool: work sharing in which the caller never waits for a helper that
// has not started.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends at a barrier that every thread of
// the team must reach. On a machine whose cores also run a server's other work (the gRPC
// thread, the gateway, the block store), the scheduler often has one of the two engine
// threads off its core for a while, and every region then waits for it: measured on 2 cores,
// a decode worker serving one stream ran its steps at 19 ms instead of the 8.4 ms they take
// alone, most of it in OpenMP's barrier. Here a call is split into small chunks claimed from
// an atomic counter; the caller claims chunks too, and when none is left it waits only for
// chunks already claimed. A helper that wakes late finds nothing to do.
//
// Threads: as many as torch's (at::get_num_threads(), so --threads governs them), the
// caller included. Helpers spin briefly on the next task, then sleep. One call at a time:
// a second thread calling while a call runs does its work alone.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() std::this_thread::yield()
#endif

#include "kernels.h"

namespace {

constexpr int kSpinIterations = 20000;  // about 0.1 ms of pause before a helper sleeps
constexpr int64_t kChunksPerThread = 8;

struct Task {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0, chunk = 1;
  int num_helpers = 0;  // helpers allowed to join (threads - 1)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs chunks until none is left; returns when this thread has no more.
  void work() {
    while (true) {
      const int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
      if (begin >= n) return;
      const int64_t end = std::min(n, begin + chunk);
      (*fn)(begin, end);
      done.fetch_add(end - begin, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int threads = std::max(1, at::get_num_threads());
    const int64_t chunk =
        std::max<int64_t>(grain, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
    std::unique_lock<std::mutex> caller(call_mutex_, std::try_to_lock);
    if (threads == 1 || n <= chunk || !caller.owns_lock()) {
      fn(0, n);  // one chunk, one thread, or another call in flight: alone
      return;
    }
    ensure_helpers(threads - 1);
    Task task;
    task.fn = &fn;
    task.n = n;
    task.chunk = chunk;
    task.num_helpers = threads - 1;
    current_.store(&task, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    task.work();
    while (task.done.load(std::memory_order_acquire) < n) PDSERVE_PAUSE();
    // No helper may still look at the task once this call returns: it announces itself in
    // in_task_ before reading current_, so after this store and this wait none holds it.
    current_.store(nullptr, std::memory_order_seq_cst);
    while (in_task_.load(std::memory_order_seq_cst) > 0) PDSERVE_PAUSE();
  }

 private:
  void ensure_helpers(int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(helpers_.size()) < count) {
      const int index = static_cast<int>(helpers_.size());
      helpers_.emplace_back([this, index] { helper(index); });
    }
  }

  void helper(int index) {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    while (true) {
      // Spin for the next task, then sleep until one comes.
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen && spins < kSpinIterations) {
        PDSERVE_PAUSE();
        ++spins;
      }
      if (epoch_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return stop_ || epoch_.load(std::memory_order_seq_cst) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        if (stop_) return;
      }
      seen = epoch_.load(std::memory_order_acquire);
      in_task_.fetch_add(1, std::memory_order_seq_cst);
      Task* task = current_.load(std::memory_order_seq_cst);
      if (task != nullptr && index < task->num_helpers) task->work();
      in_task_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex call_mutex_;  // one call at a time
  std::mutex mutex_;       // helpers' sleep and the helper list
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  std::atomic<Task*> current_{nullptr};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> in_task_{0};
  std::atomic<int> sleeping_{0};
  bool stop_ = false;
};

Pool& pool() {
  // Never destroyed: helpers must not be joined while the interpreter tears down.
  static Pool* instance = new Pool();
  return *instance;
}

}  // namespace

namespace pdserve_cpu {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  pool().run(n, std::max<int64_t>(1, grain), fn);
}

}  // namespace pdserve_cpu
