// write_file_atomic: a reader sees the old file or the new one whole, also with two writers of
// one path at once (their temporary files were one name per process).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <unistd.h>

#include "io/atomic_file.h"
#include "util/error.h"

using namespace kvx::io;

TEST(WriteFileAtomic, TwoThreadsWritingOnePathLeaveOneWholeFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvx_test_atomic_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.json").string();
  const std::string a(1 << 16, 'a'), b(1 << 16, 'b');
  std::string errors[2];
  auto writer = [&](int w) {
    try {
      for (int i = 0; i < 40; ++i) write_file_atomic(path, w == 0 ? a : b);
    } catch (const std::exception& e) {
      errors[w] = e.what();
    }
  };
  std::thread t0(writer, 0), t1(writer, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  const std::string got = read_file(path);
  EXPECT_TRUE(got == a || got == b) << "a torn file of " << got.size() << " bytes";
  size_t left = 0;  // no temporary files behind
  for (const auto& e : std::filesystem::directory_iterator(dir)) left += e.path().filename() != "state.json";
  EXPECT_EQ(left, 0u);
  std::filesystem::remove_all(dir);
}
