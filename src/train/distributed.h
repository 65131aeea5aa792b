// Data-parallel training on libtorch's c10d with the Gloo backend (no home-made protocol).
//
// Workers rendezvous through a c10d TCPStore hosted by rank 0 at master_addr:master_port, then
// form a ProcessGroupGloo. `kvx train --nproc N` launches N local workers (launch_workers) and
// passes their coordinates in the environment, as torchrun does; on several machines each runs
// `kvx train --world-size W --rank R --master-addr A --master-port P`.
//
// Gradients are averaged by GradientBuckets: parameters are grouped into buckets of about
// bucket_bytes in reverse registration order (the order backward produces them) and each
// bucket's all-reduce is launched from autograd hooks as soon as it (and every bucket before it)
// is complete, so communication overlaps the rest of the backward pass (what PyTorch's DDP does).
// Every worker must train the same model config (checked at start by run_training).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace kvx::train {

struct DistributedOptions {
  int world_size = 1, rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_seconds = 300;  // rendezvous and every collective; a dead worker ends the others after this at most
                                 // (it must exceed rank 0's evaluation and checkpoint time)
  int local_workers = 1;         // workers on this machine (memory and cores are shared among them)

  bool enabled() const { return world_size > 1; }
  void validate() const;  // throws kvx::Error naming the bad value
  // KVX_WORLD_SIZE, KVX_RANK, KVX_MASTER_ADDR, KVX_MASTER_PORT, KVX_LOCAL_WORKERS as set by
  // launch_workers (world 1 if unset).
  static DistributedOptions from_env();
};

class ProcessGroup {
 public:
  explicit ProcessGroup(const DistributedOptions& options);  // blocks until every rank has joined
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  bool is_root() const { return options_.rank == 0; }

  void broadcast(std::vector<torch::Tensor>& tensors);  // rank 0's values to every rank, in place
  double mean(double value);                             // over ranks
  void sum(torch::Tensor& t);                            // over ranks, in place
  std::string broadcast_string(const std::string& value);              // rank 0's value
  std::vector<std::string> gather_strings(const std::string& value);   // every rank's, in rank order (all ranks get them)
  void barrier();

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  DistributedOptions options_;
  std::unique_ptr<Impl> impl_;
  int64_t exchanges_ = 0;  // store keys are numbered per exchange
};

class GradientBuckets {
 public:
  GradientBuckets(ProcessGroup& group, std::vector<torch::Tensor> params, size_t bucket_bytes = size_t{4} << 20);
  ~GradientBuckets();
  // After backward: launches what the hooks did not (unused parameters count as zero), waits,
  // and writes the ranks' mean gradient into every parameter's .grad.
  void finish();
  double seconds_waiting() const { return waiting_; }  // in finish(), cumulative: the part not overlapped
  double bytes_per_step() const;                        // gradient bytes all-reduced per step

 private:
  struct Bucket;
  void ready(size_t param);
  void launch(Bucket& b);
  ProcessGroup& group_;
  std::vector<torch::Tensor> params_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::pair<size_t, int64_t>> where_;  // param -> (bucket, offset)
  std::vector<unsigned> hooks_;                    // param -> its hook
  std::vector<char> fired_;                        // param -> its gradient arrived this step
  size_t next_ = 0;                                // the next bucket to launch
  double waiting_ = 0;
};

// Which port to use: `port` if free (else an error naming it), or a free one when port == 0.
int choose_port(const std::string& addr, int port);

// Runs argv N times with KVX_WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT/LOCAL_WORKERS set, rank 0's output
// shown, the others' kept in `log_dir`/worker-<rank>.log; when one fails, stops the rest and
// returns its exit status (0 if all succeed).
int launch_workers(const std::vector<std::string>& argv, int nproc, const std::string& addr, int port,
                   const std::string& log_dir);

}  // namespace kvx::train
