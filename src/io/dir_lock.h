// An exclusive lock on a directory that one job writes (a training run's directory), so that a
// second job started into it is refused instead of interleaving checkpoints with the first.
#pragma once
#include <string>

namespace kvx::io {

// flock(2) on DIR/.kvx.lock, held while the object lives. The kernel drops it when the process
// ends, however it ends, so a killed run leaves nothing stale behind. The file holds the
// holder's pid, which the refusal names.
class DirLock {
 public:
  // Throws kvx::Error naming `what`, the directory and the holder's pid if another run holds it
  // (another process, or another DirLock in this one). `dir` must exist.
  DirLock(const std::string& dir, const std::string& what);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace kvx::io
