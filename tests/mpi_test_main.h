// The world of a multi-process GoogleTest suite, for tests linked with tests/mpi_test_main.cc
// (the one main of every such suite; run it under mpirun or srun, or alone as world size 1).
// Every rank runs every test; only rank 0 prints; the exit status is a failure on every rank
// when any rank failed.
#pragma once

#include "comm/communicator.h"
#include "cpd/config.h"
#if CPD_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

namespace cpd::test {

// The communicator of all ranks: an MpiCommunicator in builds with MPI, else world size 1.
comm::Communicator* World();
#if CPD_WITH_MPI
comm::MpiCommunicator* MpiWorld();
#endif

}  // namespace cpd::test
