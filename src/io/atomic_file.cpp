#include "io/atomic_file.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/error.h"

namespace kvx::io {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw Error("'" + path + "' is a directory where a file was expected; give the file's path");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open '" + path + "': " + std::strerror(errno) + "; check the path");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) { return fs::exists(path); }

void make_dirs(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) throw Error("cannot create directory '" + path + "': " + ec.message());
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  fs::path target(path);
  if (target.has_parent_path()) make_dirs(target.parent_path().string());
  // unique per process and per call: two threads writing one path must not share a temp file
  static std::atomic<uint64_t> serial{0};
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw Error("cannot write '" + tmp + "': " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error("write to '" + tmp + "' failed: " + std::strerror(e) + " (disk full?)");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error("cannot flush '" + tmp + "': " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(e));
  }
  fsync_dir(target.has_parent_path() ? target.parent_path().string() : ".");
}

namespace {
double free_disk_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) throw Error("cannot query free space of '" + dir + "': " + std::strerror(errno));
  return static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize);
}
}  // namespace

void check_output_dir(const std::string& dir, double bytes_needed, const std::string& what) {
  try {
    make_dirs(dir);
    write_file_atomic(dir + "/.kvx_write_probe", "probe\n");
  } catch (const Error& e) {
    throw Error(what + ": the output directory '" + dir + "' is not writable (" + e.what() +
                "); choose another directory or fix its permissions");
  }
  ::unlink((dir + "/.kvx_write_probe").c_str());
  const double free = free_disk_bytes(dir);
  if (free < bytes_needed) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "needs about %.1f MiB on disk but '%s' has %.1f MiB free", bytes_needed / 1048576.0,
                  dir.c_str(), free / 1048576.0);
    throw Error(what + " " + buf + "; free some space or write elsewhere");
  }
}

}  // namespace kvx::io
