// The kernels' thread pool: work sharing in which the caller never waits for a helper that
// has not started.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends at a barrier that every thread of
// the team must reach. On a machine whose cores also run a server's other work (the gRPC
// thread, the gateway, the block store), the scheduler often has one of the two engine
// threads off its core for a while, and every region then waits for it: measured on 2 cores,
// a decode worker serving one stream ran its steps at 19 ms instead of the 8.4 ms they take
// alone, most of it in OpenMP's barrier. Here each thread (the caller too) owns a contiguous
// share of a call's range and claims small chunks from its front; a thread whose share is
// done takes chunks from the back of the others', and when none is left anywhere the caller
// waits only for chunks already claimed. A helper that wakes late finds its share taken.
// Contiguous shares, rather than chunks dealt from one counter in turn, keep each thread on
// one run of addresses (a lone row's weights stream through the hardware prefetchers as one
// stream a thread, not one per chunk).
//
// Threads: as many as torch's (at::get_num_threads(), so --threads governs them), the
// caller included. Helpers spin briefly on the next task, then sleep. A spinning thread (a
// helper between tasks, the caller waiting for a claimed chunk) offers its core to the
// machine's other runnable threads every kPausesPerYield pauses: on 2 cores shared with the
// gateway, the gRPC thread and the block store, the stack at 16 streams gave 6.7 % more
// tokens a second (median of 4 alternations; docs/benchmarks/2026-12-04-quant/README.md),
// and where nothing else wants the core the yield returns at once. One call at a time: a
// second thread calling while a call runs does its work alone.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() std::this_thread::yield()
#endif

#include "kernels.h"

namespace {

constexpr int kSpinIterations = 20000;  // about 0.1 ms of pause before a helper sleeps
constexpr int kPausesPerYield = 64;     // a spinning thread offers its core this often
constexpr int64_t kChunksPerThread = 8;
constexpr int kMaxThreads = 64;

// One thread's share of a call, [lo, hi) packed in one word: its owner claims chunks from
// lo upward, a thread whose own share is done takes chunks from hi downward.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
};

// One pause of a spinning thread, the ``spins``-th: every kPausesPerYield-th also offers the
// core to whatever else is runnable.
inline void pause_or_yield(int spins) {
  PDSERVE_PAUSE();
  if (spins % kPausesPerYield == 0) sched_yield();
}

uint64_t pack(int64_t lo, int64_t hi) {
  return (static_cast<uint64_t>(lo) << 32) | static_cast<uint64_t>(hi);
}
int64_t lo_of(uint64_t r) { return static_cast<int64_t>(r >> 32); }
int64_t hi_of(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }

struct Task {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0, chunk = 1;
  int num_threads = 1;    // shares: the caller's (0) and one per helper allowed to join
  alignas(64) std::atomic<int64_t> done{0};
  Share* shares = nullptr;  // num_threads of them, the pool's (one call at a time)

  // Each thread walks its own contiguous share from the front (one run of addresses, which
  // the hardware prefetchers follow across chunks), then takes chunks from the back of the
  // others' shares; returns when none is left anywhere.
  void work(int self) {
    int64_t ran = 0;
    while (true) {  // own share, front first
      uint64_t r = shares[self].range.load(std::memory_order_relaxed);
      const int64_t lo = lo_of(r), hi = hi_of(r);
      if (lo >= hi) break;
      const int64_t end = std::min(hi, lo + chunk);
      if (!shares[self].range.compare_exchange_weak(r, pack(end, hi), std::memory_order_relaxed))
        continue;
      (*fn)(lo, end);
      ran += end - lo;
    }
    for (int k = 1; k < num_threads; ++k) {  // the others' shares, back first
      Share& other = shares[(self + k) % num_threads];
      while (true) {
        uint64_t r = other.range.load(std::memory_order_relaxed);
        const int64_t lo = lo_of(r), hi = hi_of(r);
        if (lo >= hi) break;
        const int64_t begin = std::max(lo, hi - chunk);
        if (!other.range.compare_exchange_weak(r, pack(lo, begin), std::memory_order_relaxed))
          continue;
        (*fn)(begin, hi);
        ran += hi - begin;
      }
    }
    if (ran > 0) done.fetch_add(ran, std::memory_order_release);
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
    const int threads = std::min(kMaxThreads, std::max(1, at::get_num_threads()));
    const int64_t chunk =
        std::max<int64_t>(grain, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
    std::unique_lock<std::mutex> caller(call_mutex_, std::try_to_lock);
    if (threads == 1 || n <= chunk || n > 0xffffffffLL || !caller.owns_lock()) {
      fn(0, n);  // one chunk, one thread, or another call in flight: alone
      return;
    }
    ensure_helpers(threads - 1);
    Task task;
    task.fn = &fn;
    task.n = n;
    task.chunk = chunk;
    task.num_threads = threads;
    task.shares = shares_;
    for (int t = 0; t < threads; ++t)
      shares_[t].range.store(pack(n * t / threads, n * (t + 1) / threads),
                             std::memory_order_relaxed);
    current_.store(&task, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    task.work(0);
    for (int spins = 1; task.done.load(std::memory_order_acquire) < n; ++spins)
      pause_or_yield(spins);
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
      while (epoch_.load(std::memory_order_acquire) == seen && spins < kSpinIterations)
        pause_or_yield(++spins);
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
      if (task != nullptr && index + 1 < task->num_threads) task->work(index + 1);
      in_task_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex call_mutex_;  // one call at a time
  Share shares_[kMaxThreads];  // the call in flight's, written only before it is published
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
