#include "io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "util/error.h"

namespace kvx::io {

DirLock::DirLock(const std::string& dir, const std::string& what) {
  const std::string path = dir + "/.kvx.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw Error(what + ": cannot open the lock file '" + path + "': " + std::strerror(errno) +
                "; choose another directory or fix its permissions");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char holder[32] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (e != EWOULDBLOCK) throw Error(what + ": cannot lock '" + path + "': " + std::strerror(e));
    std::string pid(holder, n > 0 ? static_cast<size_t>(n) : 0);
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    throw Error(what + ": the directory '" + dir + "' is in use by another kvx run" +
                (pid.empty() ? std::string() : " (pid " + pid + ")") +
                "; wait for it to finish, stop it, or write to another directory");
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  // Without the pid the lock still holds; only a refusal's message is poorer.
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace kvx::io
