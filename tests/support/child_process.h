// Tests that need a separate process (kills, several workers) re-execute this test binary with
// a gtest filter naming a worker test and extra environment; everything the child needs is
// prepared before fork (only async-signal-safe calls between fork and exec).
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <string>
#include <vector>

extern char** environ;

namespace kvx::testing {

// Starts `/proc/self/exe --gtest_filter=<test>` with this process's environment, minus variables
// named in `env` (NAME=value), plus `env`; output to `log` ("" = /dev/null); with
// file_size_limit > 0, writes past that many bytes fail with EFBIG (a full disk, as the kernel
// reports it).
inline pid_t spawn_test_process(const std::string& test, const std::vector<std::string>& env, const std::string& log = "",
                                rlim_t file_size_limit = 0) {
  std::vector<std::string> all;
  for (char** e = environ; *e; ++e) {
    const std::string s(*e);
    bool replaced = false;
    for (const auto& v : env) replaced |= s.compare(0, v.find('=') + 1, v, 0, v.find('=') + 1) == 0;
    if (!replaced) all.push_back(s);
  }
  all.insert(all.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& s : all) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string arg0 = "kvx_tests", arg1 = "--gtest_filter=" + test;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  const std::string out = log.empty() ? "/dev/null" : log;
  const pid_t pid = fork();
  if (pid == 0) {
    if (file_size_limit > 0) {
      const rlimit r{file_size_limit, file_size_limit};
      setrlimit(RLIMIT_FSIZE, &r);
      signal(SIGXFSZ, SIG_IGN);
    }
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execve("/proc/self/exe", argv, envp.data());
    _exit(127);
  }
  return pid;
}

}  // namespace kvx::testing
