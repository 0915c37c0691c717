// Waiting for MPI requests without spinning a core.
//
// MPICH's blocking calls poll until their data arrives: a rank waiting for a slower peer, or
// for a 1 Gbit/s link, burns a whole core that the framework's compute threads need (2 busy
// threads per rank on a CPU node; on a GPU node the data loader's).  The engine's transport
// therefore starts nonblocking operations and waits with QuietWait: a short spin keeps the
// latency of quick completions (shared memory, a peer already there), then sleeps that grow
// to `longest_sleep_us` bound the cost of each idle wake-up to a few microseconds.
#pragma once

#include <sys/prctl.h>

#include <chrono>
#include <thread>

namespace aiak {
namespace engine {

struct QuietWaitConfig {
  double spin_us = 20;          // test without sleeping for this long after progress
  double longest_sleep_us = 100;  // the longest pause between two tests (0: spin, as MPI does)
};

class QuietWait {
 public:
  explicit QuietWait(const QuietWaitConfig& config) : config_(config) { fine_timer_slack(); }

  // Call after each test of the requests: `moved` says whether anything completed.
  void after_test(bool moved) {
    using clock = std::chrono::steady_clock;
    if (moved || config_.longest_sleep_us <= 0) {
      idle_since_ = clock::time_point{};
      sleep_us_ = 0;
      return;
    }
    auto now = clock::now();
    if (idle_since_ == clock::time_point{}) idle_since_ = now;
    if (std::chrono::duration<double, std::micro>(now - idle_since_).count() < config_.spin_us)
      return;
    sleep_us_ = sleep_us_ <= 0 ? 2 : std::min(sleep_us_ * 2, config_.longest_sleep_us);
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us_));
  }

 private:
  // Linux rounds a thread's sleeps up by its timer slack (50 us by default), which would
  // make every short pause 50 us long; the engine thread asks for 1 us once.
  static void fine_timer_slack() {
    thread_local bool done = false;
    if (!done) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    done = true;
  }

  QuietWaitConfig config_;
  std::chrono::steady_clock::time_point idle_since_{};
  double sleep_us_ = 0;
};

}  // namespace engine
}  // namespace aiak
