#include "train/distributed.h"

#define USE_C10D_GLOO 1  // ProcessGroupGloo.hpp declares the class only with this
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "io/atomic_file.h"
#include "util/error.h"
#include "util/strings.h"

extern char** environ;

namespace kvx::train {

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int env_int(const char* name, int fallback) {
  const std::string v = env_or(name, "");
  if (v.empty()) return fallback;
  if (const auto x = whole_int(v)) return *x;
  throw Error(std::string(name) + "='" + v + "' is not an integer");
}

std::string where(const DistributedOptions& o) { return o.master_addr + ":" + std::to_string(o.master_port); }

// c10d reports failures as c10::Error with long messages; keep the first line.
std::string first_line(const std::exception& e) {
  std::string s = e.what();
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// This machine's address on the route to rank 0 (hostname lookups give 127.0.1.1 on Debian).
std::string address_towards(const DistributedOptions& o) {
  if (o.master_addr == "127.0.0.1" || o.master_addr == "localhost") return "127.0.0.1";
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(o.master_port));
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  char buf[INET_ADDRSTRLEN] = {};
  socklen_t len = sizeof sa;
  const bool ok = fd >= 0 && ::inet_pton(AF_INET, o.master_addr.c_str(), &sa.sin_addr) == 1 &&
                  ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0 &&
                  ::inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf) != nullptr;
  if (fd >= 0) ::close(fd);
  if (!ok)
    throw Error("cannot find this machine's address towards --master-addr " + o.master_addr +
                " (give rank 0's IPv4 address, or set GLOO_SOCKET_IFNAME to the network interface)");
  return buf;
}

// Waits for a collective; a peer that died or hung becomes a clear error.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, int rank, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(rank) + ": " + what + " failed (" + first_line(e) +
                "); another worker has probably died or stopped responding, see its log");
  }
}

}  // namespace

void DistributedOptions::validate() const {
  if (world_size < 1) throw Error("--world-size must be >= 1, got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw Error("--rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size) + ") for --world-size " +
                std::to_string(world_size));
  if (master_port < 1 || master_port > 65535)
    throw Error("--master-port must be in [1, 65535], got " + std::to_string(master_port));
  if (!(timeout_seconds > 0 && timeout_seconds <= 1e6))
    throw Error("--timeout must be in (0, 1e6] seconds, got " + std::to_string(timeout_seconds));
}

DistributedOptions DistributedOptions::from_env() {
  DistributedOptions o;
  o.world_size = env_int("KVX_WORLD_SIZE", 1);
  o.rank = env_int("KVX_RANK", 0);
  o.master_addr = env_or("KVX_MASTER_ADDR", o.master_addr);
  o.master_port = env_int("KVX_MASTER_PORT", o.master_port);
  o.local_workers = env_int("KVX_LOCAL_WORKERS", 1);
  o.validate();
  return o;
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

ProcessGroup::ProcessGroup(const DistributedOptions& options) : options_(options), impl_(std::make_unique<Impl>()) {
  options_.validate();
  // Gloo and the TCP store write to their peers' sockets without MSG_NOSIGNAL (Python ignores
  // SIGPIPE for them): a write to a worker that died would kill this one by SIGPIPE, silently,
  // instead of failing the collective with the error wait_for gives (seen once in
  // DataParallel.WithoutTheLauncherASurvivingWorkerStopsWithAClearError). Ignored, the write fails
  // with EPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(options_.master_port);
    so.isServer = options_.rank == 0;
    so.numWorkers = options_.world_size;
    so.waitWorkers = true;
    so.timeout = timeout;
    impl_->store = c10::make_intrusive<c10d::TCPStore>(options_.master_addr, so);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(options_.rank) + ": rendezvous at " + where(options_) + " failed (" + first_line(e) +
                "); start all " + std::to_string(options_.world_size) +
                " ranks with the same --master-addr/--master-port, rank 0 first, within the timeout");
  }
  try {
    auto go = c10d::ProcessGroupGloo::Options::create();
    go->timeout = timeout;
    const std::string ifname = env_or("GLOO_SOCKET_IFNAME", "");
    go->devices.push_back(ifname.empty() ? c10d::ProcessGroupGloo::createDeviceForHostname(address_towards(options_))
                                         : c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, options_.rank, options_.world_size, go);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(options_.rank) + ": cannot form the Gloo process group (" + first_line(e) + ")");
  }
}

ProcessGroup::~ProcessGroup() = default;

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors) {
  for (auto& t : tensors) {
    std::vector<at::Tensor> one{t};
    wait_for(impl_->pg->broadcast(one), rank(), "broadcast");
  }
}

double ProcessGroup::mean(double value) {
  auto t = torch::tensor({value}, torch::kDouble);
  sum(t);
  return t.item<double>() / options_.world_size;
}

void ProcessGroup::sum(torch::Tensor& t) {
  std::vector<at::Tensor> one{t};
  wait_for(impl_->pg->allreduce(one), rank(), "all-reduce");
}

std::string ProcessGroup::broadcast_string(const std::string& value) {
  const std::string key = "bcast/" + std::to_string(exchanges_++);
  if (is_root()) impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  try {
    const auto v = impl_->store->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(rank()) + ": waiting for rank 0 failed (" + first_line(e) +
                "); it has probably died or stopped responding, see its log");
  }
}

std::vector<std::string> ProcessGroup::gather_strings(const std::string& value) {
  const std::string key = "gather/" + std::to_string(exchanges_++) + "/";
  impl_->store->set(key + std::to_string(rank()), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<std::string> all;
  for (int r = 0; r < world_size(); ++r) try {
      const auto v = impl_->store->get(key + std::to_string(r));
      all.emplace_back(v.begin(), v.end());
    } catch (const std::exception& e) {
      throw Error("rank " + std::to_string(rank()) + ": waiting for rank " + std::to_string(r) + " failed (" +
                  first_line(e) + "); it has probably died or stopped responding, see its log");
    }
  return all;
}

void ProcessGroup::barrier() { wait_for(impl_->pg->barrier(), rank(), "barrier"); }

// --- gradient buckets ---------------------------------------------------------------------------

struct GradientBuckets::Bucket {
  torch::Tensor flat;              // the bucket's gradients, concatenated
  std::vector<size_t> params;
  size_t ready = 0;
  c10::intrusive_ptr<c10d::Work> work;  // the launched all-reduce
};

GradientBuckets::GradientBuckets(ProcessGroup& group, std::vector<torch::Tensor> params, size_t bucket_bytes)
    : group_(group), params_(std::move(params)), where_(params_.size()), fired_(params_.size(), 0) {
  // Reverse registration order: the last layers' gradients come first in backward.
  for (size_t k = params_.size(); k-- > 0;) {
    const int64_t bytes = params_[k].numel() * static_cast<int64_t>(sizeof(float));
    if (buckets_.empty() || buckets_.back()->flat.numel() * 4 + bytes > static_cast<int64_t>(bucket_bytes)) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->flat = torch::empty({0}, torch::kFloat);
    }
    Bucket& b = *buckets_.back();
    where_[k] = {buckets_.size() - 1, b.flat.numel()};
    b.params.push_back(k);
    b.flat = torch::empty({b.flat.numel() + params_[k].numel()}, torch::kFloat);
  }
  for (const auto& p : params_)
    if (p.scalar_type() != torch::kFloat) throw Error("GradientBuckets: parameters must be float32");
  for (size_t k = 0; k < params_.size(); ++k) {
    hooks_.push_back(params_[k].register_hook([this, k](const torch::Tensor& grad) {
      auto& [bi, off] = where_[k];
      buckets_[bi]->flat.narrow(0, off, grad.numel()).copy_(grad.reshape({-1}));
      ready(k);
    }));
  }
}

GradientBuckets::~GradientBuckets() {
  for (size_t k = 0; k < params_.size(); ++k) params_[k].remove_hook(hooks_[k]);  // they capture `this`
}

// Buckets are launched strictly in bucket order (Gloo pairs the ranks' collectives by call order),
// each as soon as it and every bucket before it are complete.
void GradientBuckets::ready(size_t param) {
  fired_[param] = 1;
  ++buckets_[where_[param].first]->ready;
  while (next_ < buckets_.size() && buckets_[next_]->ready == buckets_[next_]->params.size()) launch(*buckets_[next_++]);
}

void GradientBuckets::launch(Bucket& b) {
  std::vector<at::Tensor> t{b.flat};
  b.work = group_.impl().pg->allreduce(t);
}

void GradientBuckets::finish() {
  const auto t0 = std::chrono::steady_clock::now();
  for (; next_ < buckets_.size(); ++next_) {  // parameters without a gradient this step count as zero
    Bucket& b = *buckets_[next_];
    for (size_t k : b.params)
      if (!fired_[k]) b.flat.narrow(0, where_[k].second, params_[k].numel()).zero_();
    launch(b);
  }
  next_ = 0;
  for (auto& b : buckets_) {
    wait_for(b->work, group_.rank(), "gradient all-reduce");
    b->flat.div_(group_.world_size());
    for (size_t k : b->params) {
      auto& p = params_[k];
      auto g = b->flat.narrow(0, where_[k].second, p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(g);
      else
        p.mutable_grad() = g.clone();
    }
    b->ready = 0;
    b->work.reset();
    for (size_t k : b->params) fired_[k] = 0;
  }
  waiting_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double GradientBuckets::bytes_per_step() const {
  double n = 0;
  for (const auto& b : buckets_) n += static_cast<double>(b->flat.numel()) * 4;
  return n;
}

// --- launcher -----------------------------------------------------------------------------------

int choose_port(const std::string& addr, int port) {
  if (port < 0 || port > 65535) throw Error("--master-port must be in [0, 65535], got " + std::to_string(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("cannot open a socket: ") + std::strerror(errno));
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);  // as the TCP store binds: TIME_WAIT is no obstacle
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, addr == "localhost" ? "127.0.0.1" : addr.c_str(), &sa.sin_addr) != 1) {
    ::close(fd);
    throw Error("--master-addr '" + addr + "' is not an IPv4 address of this machine");
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error("port " + std::to_string(port) + " on " + addr + " is not available (" + std::strerror(e) +
                "); pass another --master-port, or 0 to pick a free one");
  }
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

namespace {
// The launcher's workers, for its SIGTERM/SIGINT handler: a stop request reaches every worker.
constexpr int kMaxLocalWorkers = 1024;
volatile sig_atomic_t g_workers[kMaxLocalWorkers];
volatile sig_atomic_t g_worker_count = 0;
void forward_signal(int sig) {
  for (int i = 0; i < g_worker_count; ++i)
    if (g_workers[i] > 0) ::kill(static_cast<pid_t>(g_workers[i]), sig);
}
}  // namespace

int launch_workers(const std::vector<std::string>& argv, int nproc, const std::string& addr, int port,
                   const std::string& log_dir) {
  if (nproc > kMaxLocalWorkers) throw Error("--nproc is at most " + std::to_string(kMaxLocalWorkers) + " on one machine");
  if (nproc < 1) throw Error("--nproc must be >= 1, got " + std::to_string(nproc));
  if (!log_dir.empty()) io::make_dirs(log_dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string s(*e);
      if (s.rfind("KVX_WORLD_SIZE=", 0) && s.rfind("KVX_RANK=", 0) && s.rfind("KVX_MASTER_", 0) && s.rfind("KVX_LOCAL_", 0))
        env.push_back(s);
    }
    env.push_back("KVX_WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("KVX_RANK=" + std::to_string(r));
    env.push_back("KVX_MASTER_ADDR=" + addr);
    env.push_back("KVX_MASTER_PORT=" + std::to_string(port));
    env.push_back("KVX_LOCAL_WORKERS=" + std::to_string(nproc));
    std::vector<std::string> args = argv;
    std::vector<char*> cargs, cenv;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    const std::string log = log_dir.empty() || r == 0 ? "" : log_dir + "/worker-" + std::to_string(r) + ".log";
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int e = errno;
      for (pid_t p : pids) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
      throw Error(std::string("cannot start a worker: ") + std::strerror(e));
    }
    if (pid == 0) {
      if (!log.empty()) {
        // appended: a second launch into a directory a live run holds (refused at its lock) must
        // not wipe that run's logs
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) ::dup2(fd, 1), ::dup2(fd, 2);
      }
      ::execve("/proc/self/exe", cargs.data(), cenv.data());
      _exit(127);
    }
    pids.push_back(pid);
    g_workers[r] = pid;
    g_worker_count = r + 1;
  }
  struct sigaction sa {}, old_term {}, old_int {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGTERM, &sa, &old_term);
  ::sigaction(SIGINT, &sa, &old_int);
  // The first worker to fail stops the rest (they would otherwise wait for it until the timeout).
  int result = 0;
  size_t alive = pids.size();
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0 && errno == EINTR) continue;
    if (pid < 0) break;
    int rank = -1;
    for (size_t r = 0; r < pids.size(); ++r)
      if (pids[r] == pid) rank = static_cast<int>(r), pids[r] = -1;
    if (rank < 0) continue;
    --alive;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && result == 0) {
      result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      std::fprintf(stderr, "worker %d %s; stopping the other workers%s\n", rank,
                   WIFEXITED(status) ? ("exited with status " + std::to_string(WEXITSTATUS(status))).c_str()
                                     : ("was killed by signal " + std::to_string(WTERMSIG(status))).c_str(),
                   rank > 0 && !log_dir.empty() ? (" (its log: " + log_dir + "/worker-" + std::to_string(rank) + ".log)").c_str()
                                                : "");
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGTERM);
    }
    g_workers[rank] = 0;
  }
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGINT, &old_int, nullptr);
  g_worker_count = 0;
  return result;
}

}  // namespace kvx::train
