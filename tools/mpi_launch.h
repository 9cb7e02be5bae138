// Whether this process is one rank of a job an MPI launcher started: the environment the
// launcher sets, read here in tools/ (the libraries below take a communicator instead).
#pragma once

namespace strata::tools {

// True when this process was started by an MPI launcher (mpirun, srun with PMIx): one of the
// OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_SIZE variables is set. Thread-safe as long as nothing
// changes the environment meanwhile.
bool LaunchedByMpi();

}  // namespace strata::tools
