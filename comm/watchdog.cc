// The collective watchdog; see watchdog.h for the contract.
#include "comm/watchdog.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>
#include <vector>

namespace strata::comm::internal {

Watchdog::Watchdog(int rank, std::function<void(const std::string& line)> on_timeout)
    : rank_(rank), on_timeout_(std::move(on_timeout)) {
  thread_ = std::thread([this] { Run(); });
}

Watchdog::~Watchdog() { Stop(); }

uint64_t Watchdog::Begin(const char* collective, double timeout_seconds) {
  const Clock::time_point now = Clock::now();
  const auto timeout =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    running_.emplace(id, Entry{collective, now, now + timeout});
  }
  cv_.notify_one();  // the new deadline may be the earliest
  return id;
}

void Watchdog::End(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  running_.erase(id);
}

void Watchdog::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const Clock::time_point now = Clock::now();
    std::vector<std::string> lines;
    Clock::time_point earliest = Clock::time_point::max();
    for (auto it = running_.begin(); it != running_.end();) {
      if (it->second.deadline <= now) {
        const double waited = std::chrono::duration<double>(now - it->second.start).count();
        lines.push_back(fmt::format(
            "strata: rank {}: {} waited {:.0f} s for the other ranks; a rank died or hangs: "
            "aborting the job",
            rank_, it->second.collective, std::floor(waited)));
        it = running_.erase(it);  // fires once
      } else {
        earliest = std::min(earliest, it->second.deadline);
        ++it;
      }
    }
    if (!lines.empty()) {
      lock.unlock();
      for (const std::string& line : lines) on_timeout_(line);
      lock.lock();
      continue;
    }
    if (earliest == Clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, earliest);
    }
  }
}

Watchdog::Scope::Scope(Watchdog* watchdog, const char* collective, double timeout_seconds) {
  if (watchdog == nullptr || !(timeout_seconds > 0)) return;
  watchdog_ = watchdog;
  id_ = watchdog->Begin(collective, timeout_seconds);
}

Watchdog::Scope::~Scope() {
  if (watchdog_ != nullptr) watchdog_->End(id_);
}

}  // namespace strata::comm::internal
