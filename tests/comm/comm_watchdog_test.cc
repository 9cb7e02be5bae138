// The watchdog ending a job whose rank hangs (run by ctest under mpirun, checked by
// expect_job_abort.cmake): every rank makes an MPI communicator with a 1 s timeout; rank 1 sleeps
// 3 s before the barrier the others already wait in, so their watchdog must print
//   strata: rank 0: barrier waited 1 s for the other ranks; a rank died or hangs: aborting the job
// and end the whole job with a non-zero exit before rank 1 arrives. A job that gets past the
// barrier prints why it should not have and exits 0, which the check counts as a failure.
#include <chrono>
#include <cstdio>
#include <thread>

#include "comm/communicator.h"
#include "tools/mpi_launch.h"

int main() {
  using strata::comm::CommOptions;
  if (!strata::tools::LaunchedByMpi()) {
    std::fprintf(stderr, "comm_watchdog_test: run it under mpirun with 2 or more ranks\n");
    return 2;
  }
  CommOptions options;
  options.timeout_seconds = 1;
  auto comm = strata::comm::CreateMpiCommunicator(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "comm_watchdog_test: %s\n", comm.status().ToString().c_str());
    return 2;
  }
  if ((*comm)->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(3));
  const strata::Status status = (*comm)->Barrier();
  std::printf(
      "comm_watchdog_test: rank %d passed the barrier (%s): the watchdog did not end the "
      "job\n",
      (*comm)->rank(), status.ToString().c_str());
  return 0;
}
