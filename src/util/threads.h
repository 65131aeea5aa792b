// Thread set-up shared by every kvx program.
#pragma once

namespace kvx {

// libtorch runs its parallel regions on OpenMP (libgomp) while its matrix products run on
// OpenBLAS's own pthreads. With libgomp's default active waiting, idle OpenMP threads spin and
// steal the cores OpenBLAS needs: on 2 cores this halved training throughput and slowed decode
// steps up to 10x (measured). libgomp reads OMP_WAIT_POLICY only at load time, so when it is
// unset this sets it to PASSIVE and re-executes the program once (same arguments).
void ensure_passive_openmp(char** argv);

// torch::set_num_threads(hardware threads) is called by the torch-side entry points; this is
// the count they use.
int hardware_threads();

}  // namespace kvx
